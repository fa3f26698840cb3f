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


def test_float_source_builds_with_rtn_int4(tmp_path, board_name):
    """An F32 GGUF goes through the round-to-nearest quantizer; errors are reported and the graph follows them."""
    import numpy as np

    import runtime
    from make_tiny_model import write_tiny_gguf
    from models.build import build_artifact
    from models.reference import Reference

    src = write_tiny_gguf(tmp_path / "f32.gguf", seed=3, float_weights=True)
    with pytest.raises(ValueError, match="needs Q4_1 weights"):
        build_artifact(str(src), tmp_path / "bad", board=board_name, backend="onnxruntime", scheme="q4_1-exact")
    manifest, report = build_artifact(str(src), tmp_path / "a", board=board_name, backend="onnxruntime",
                                      scheme="rtn-int4", accuracy_level=0, max_context=64)
    assert manifest.quantization.scheme == "rtn-int4"
    linear = {k: e for k, e in report.errors.items() if k.startswith("blk.")}
    assert len(linear) == 14 and all(0 < e.mean_abs < e.max_abs < 0.1 for e in linear.values())
    assert report.worst_tensor in linear and report.worst_max_abs == max(e.max_abs for e in linear.values())
    model = runtime.load(tmp_path / "a")
    ids = model.tokenizer.encode("the cat sat")
    got = model.session.logits(ids).astype(np.float64)
    # the reference with the weights as quantized: the graph must compute exactly what was packed
    import gguf

    ref = Reference(read_gguf(src))
    for name in linear:
        ref.w[name] = quant.rtn_int4(ref.w[name].astype(np.float32)).dequantize().astype(np.float64)
    q8 = gguf.quants.quantize(ref.w["token_embd.weight"].astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    ref.w["token_embd.weight"] = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).astype(np.float64)
    want = ref.forward(ids)
    assert np.abs(got - want).max() < 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("typ,block,N", [("Q4_1x8", 20, 64), ("Q4_1x8", 20, 61), ("Q8_0x8", 34, 64), ("Q8_0x8", 34, 3)])
def test_native_row_groups_only_move_bytes(typ, block, N):
    """The native layout (8 rows per group, padded with zero rows) is a permutation of the GGUF bytes:
    regrouping and ungrouping gives the rows back, and every input byte appears in the groups."""
    rng = np.random.default_rng(N)
    raw = rng.integers(0, 256, (N, 18 * block), dtype=np.uint8)
    groups = (quant.interleave_q4_1 if typ == "Q4_1x8" else quant.interleave_q8_0)(raw, 576)
    assert groups.shape == (-(-N // 8), 18, quant.X8_BYTES[typ])
    assert np.array_equal(quant.deinterleave(groups, typ, N), raw)
    assert np.array_equal(np.sort(groups.reshape(-1))[-raw.size:], np.sort(raw.reshape(-1)))  # the rest is padding


def test_native_row_groups_layout_matches_the_c_kernels():
    """Spot-check the documented layout: byte 4r+i of chunk k of a Q4_1x8 block is GGUF byte 4k+i of row r."""
    raw = np.zeros((8, 20), np.uint8)
    raw[5, 4 + 4 * 2 + 1] = 0xAB  # row 5, packed byte 9 = chunk 2, i = 1
    raw[3, 0:2] = [1, 2]          # row 3's d
    raw[6, 2:4] = [3, 4]          # row 6's m
    g = quant.interleave_q4_1(raw, 32)[0, 0]
    assert g[32 + 32 * 2 + 4 * 5 + 1] == 0xAB and list(g[6:8]) == [1, 2] and list(g[16 + 12:16 + 14]) == [3, 4]
