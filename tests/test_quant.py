"""INT4/INT8 weight mapping: GGUF blocks -> MatMulNBits, exactly where the format allows."""
import numpy as np
import pytest

from models import quant
from models.arch import read_gguf


def _q41_tensors(g):
    return [n for n, t in g.tensors.items() if t.tensor_type.name == "Q4_1"]


def test_q4_1_exact_is_bit_exact_on_tiny(tiny_gguf):
    g = read_gguf(tiny_gguf)
    for n in _q41_tensors(g):
        t, raw = g.raw(n)
        K = int(g.tensors[n].shape[0])
        p = quant.from_q4_1(raw, K)
        assert np.array_equal(p.dequantize(), g.dequantized(n)), n


@pytest.mark.slow
def test_q4_1_exact_is_bit_exact_on_smollm2(real_gguf):
    """Every Q4_1 tensor of SmolLM2: our MatMulNBits form dequantizes to gguf's values bit for bit."""
    g = read_gguf(real_gguf)
    names = _q41_tensors(g)
    assert len(names) == 210
    for n in names:
        _, raw = g.raw(n)
        p = quant.from_q4_1(raw, int(g.tensors[n].shape[0]))
        ref = g.dequantized(n)
        assert np.array_equal(p.dequantize().view(np.uint32), ref.view(np.uint32)), n


@pytest.mark.slow
def test_q8_0_embedding_is_exact(real_gguf):
    g = read_gguf(real_gguf)
    _, raw = g.raw("token_embd.weight")
    p = quant.from_q8_0(raw, g.config.hidden)
    assert p.bits == 8 and p.zero_points is None
    assert np.array_equal(p.dequantize(), g.dequantized("token_embd.weight"))


def test_intzp_and_rtn_report_bounded_error(tiny_gguf):
    g = read_gguf(tiny_gguf)
    n = "blk.0.ffn_up.weight"
    _, raw = g.raw(n)
    ref = g.dequantized(n)
    p = quant.from_q4_1(raw, 64, integer_zero_point=True)
    e = quant.error(p, ref)
    d = p.scales.reshape(p.N, -1)
    # re-rounding the zero point moves a block by at most d/2 (when -m/d is inside [0, 15])
    assert 0 < e.max_abs <= float(d.max()) * 0.5 + 1e-6
    r = quant.rtn_int4(ref)
    er = quant.error(r, ref)
    assert 0 < er.mean_abs < er.max_abs <= float(r.scales.max()) * 0.5 + 1e-6


def test_rtn_int4_symmetric_and_constant_blocks():
    w = np.zeros((4, 64), np.float32)
    w[1] = 0.5  # constant block: exact
    w[2] = np.linspace(-1, 1, 64)
    for sym in (False, True):
        p = quant.rtn_int4(w, symmetric=sym)
        deq = p.dequantize()
        assert np.array_equal(deq[0], w[0])
        assert np.abs(deq - w).max() <= p.scales.max() / 2 + 1e-6


def test_pack_unpack_roundtrip():
    v = np.random.default_rng(1).integers(0, 16, (3, 5, 32)).astype(np.uint8)
    assert np.array_equal(quant.unpack_bits(quant.pack_bits(v, 4), 4), v)
    odd = np.array([[1, 2, 3]], np.uint8)
    assert quant.pack_bits(odd, 4).tolist() == [[0x21, 0x03]]


def test_concat_fuses_rows(tiny_gguf):
    g = read_gguf(tiny_gguf)
    parts = [quant.from_q4_1(g.raw(f"blk.0.attn_{x}.weight")[1], 64) for x in "qkv"]
    fused = quant.concat(parts)
    assert fused.N == sum(p.N for p in parts)
    assert np.array_equal(fused.dequantize(), np.concatenate([p.dequantize() for p in parts]))


def test_wrong_source_type_is_a_clear_error(tiny_gguf):
    g = read_gguf(tiny_gguf)
    _, raw = g.raw("token_embd.weight")
    with pytest.raises(ValueError, match="needs Q4_1"):
        quant.pack_tensor("Q8_0", raw, 64, "q4_1-exact", None)
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        quant.pack_tensor("Q4_1", raw, 64, "q3_magic", None)
