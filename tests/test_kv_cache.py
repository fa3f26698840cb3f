"""The int8 KV cache object and the quality cost of 8-bit K/V."""
import numpy as np
import pytest

from models.reference import kv_roundtrip
from runtime.kv_cache import ContextOverflow, KVCache


def _rows(t, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(-127, 128, (t, 2, 4, 8)).astype(np.int8), rng.random((t, 2, 4, 1)).astype(np.float32)


def test_preallocated_views_and_in_place_writes():
    c = KVCache(16, 2, 2, 8)
    assert c.kv.shape == (16, 2, 4, 8) and c.kv.dtype == np.int8
    base = c.kv.__array_interface__["data"][0]
    kv, sc = _rows(5)
    c.append([1, 2, 3, 4, 5], kv, sc)
    v, s = c.view()
    assert v.shape[0] == 5 and np.shares_memory(v, c.kv) and v.flags.c_contiguous
    assert np.array_equal(v, kv) and np.array_equal(s, sc)
    assert c.kv.__array_interface__["data"][0] == base  # never reallocated
    assert c.bytes_per_position == 2 * 4 * 8 + 2 * 4 * 4


def test_rewind_reset_and_common_prefix():
    c = KVCache(16, 2, 2, 8)
    c.append([1, 2, 3, 4], *_rows(4))
    assert c.common_prefix([1, 2, 9]) == 2
    assert c.common_prefix([1, 2, 3, 4, 5]) == 4
    c.rewind_to(2)
    assert c.tokens == [1, 2] and len(c) == 2
    kv, sc = _rows(1, seed=3)
    c.append([7], kv, sc)
    assert np.array_equal(c.view()[0][2], kv[0])
    with pytest.raises(ValueError):
        c.rewind_to(5)
    c.reset()
    assert len(c) == 0 and c.view()[0].shape[0] == 0


def test_overflow_is_an_error_and_loses_nothing():
    c = KVCache(4, 2, 2, 8)
    c.append([1, 2, 3], *_rows(3))
    with pytest.raises(ContextOverflow, match="max context 4"):
        c.append([4, 5], *_rows(2))
    assert c.tokens == [1, 2, 3]


def test_int8_roundtrip_error_bound():
    """Per (token, head) absmax int8: error <= scale/2 = absmax/254, relative RMS error well under 1%."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6, 64)) * rng.uniform(0.01, 10, (64, 6, 1))
    x[3, 2, 5] = 40.0  # an outlier only costs its own (token, head)
    y = kv_roundtrip(x)
    amax = np.abs(x).max(-1, keepdims=True)
    assert np.all(np.abs(y - x) <= amax / 254 * (1 + 1e-5))
    rel = np.sqrt(((y - x) ** 2).mean()) / np.sqrt((x**2).mean())
    assert rel < 0.01
    assert np.array_equal(kv_roundtrip(np.zeros((1, 1, 8))), np.zeros((1, 1, 8)))


def test_layer_major_cache_is_written_in_place_only():
    c = KVCache(8, 2, 2, 8, layer_major=True)
    assert c.kv.shape == (2, 8, 4, 8) and c.bytes_per_position == 2 * 4 * 8 + 2 * 4 * 4
    rows = c.kv[:, 0:2], c.scale[:, 0:2]  # what an in-place backend hands back
    c.append([1, 2], *rows)
    assert c.tokens == [1, 2] and c.view()[0].shape == (2, 2, 4, 8)
    with pytest.raises(ValueError, match="written in place"):
        c.append([3], *_rows(1))
