"""A float64 numpy forward pass of a Llama-family model: the golden reference for the exported graphs.

Slow and simple on purpose: whole sequence at once, no cache object. ``kv_int8=True``
applies the same per-(token, head) int8 round trip to K and V as the runtime's cache,
so the graph can be checked against it exactly as specified.
"""
from __future__ import annotations

import numpy as np

from runtime.kv_cache import KV_SCALE_FLOOR

from .arch import GGUFModel, layer_tensor


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, base: float) -> np.ndarray:
    """x (T, heads, D); adjacent pairs (x[2i], x[2i+1]) rotated by pos * base^(-2i/D)."""
    D = x.shape[-1]
    inv = base ** (-np.arange(D // 2, dtype=np.float64) * 2.0 / D)
    ang = pos[:, None].astype(np.float64) * inv[None, :]  # (T, D/2)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def kv_roundtrip(x: np.ndarray) -> np.ndarray:
    """int8 absmax per (token, head) quantize -> dequantize; x (T, heads, D), float32 math as in the graph."""
    x32 = x.astype(np.float32)
    scale = np.maximum(np.abs(x32).max(-1, keepdims=True) * np.float32(1.0 / 127.0), np.float32(KV_SCALE_FLOOR))
    q = np.rint(x32 / scale).astype(np.int8)
    return (q.astype(np.float32) * scale).astype(np.float64)


class Reference:
    def __init__(self, model: GGUFModel):
        self.cfg = model.config
        self.w: dict[str, np.ndarray] = {}
        for name in model.tensors:
            self.w[name] = np.asarray(model.dequantized(name), np.float64)

    def forward(self, ids, kv_int8: bool = True, kv_out: list | None = None) -> np.ndarray:
        """Logits (T, vocab) float64 for every position of one sequence starting at position 0.
        kv_out: a list that receives each layer's (k, v) (T, KVH, D) float64 before the int8 round trip."""
        cfg, w = self.cfg, self.w
        ids = np.asarray(ids, np.int64)
        T, H, KVH, D = len(ids), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        pos = np.arange(T)
        h = w["token_embd.weight"][ids]  # (T, C)
        mask = np.triu(np.full((T, T), -np.inf), 1)
        for i in range(cfg.n_layers):
            x = _rms(h, w[layer_tensor(i, "attn_norm")], cfg.norm_eps)
            q = (x @ w[layer_tensor(i, "attn_q")].T).reshape(T, H, D)
            k = (x @ w[layer_tensor(i, "attn_k")].T).reshape(T, KVH, D)
            v = (x @ w[layer_tensor(i, "attn_v")].T).reshape(T, KVH, D)
            q, k = _rope(q, pos, cfg.rope_base), _rope(k, pos, cfg.rope_base)
            if kv_out is not None:
                kv_out.append((k, v))
            if kv_int8:
                k, v = kv_roundtrip(k), kv_roundtrip(v)
            kr = np.repeat(k, cfg.group, axis=1)  # (T, H, D): head h uses kv head h // group
            vr = np.repeat(v, cfg.group, axis=1)
            s = np.einsum("thd,shd->hts", q, kr) / np.sqrt(D) + mask
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            ctx = np.einsum("hts,shd->thd", p, vr).reshape(T, H * D)
            h = h + ctx @ w[layer_tensor(i, "attn_output")].T
            x = _rms(h, w[layer_tensor(i, "ffn_norm")], cfg.norm_eps)
            gate = x @ w[layer_tensor(i, "ffn_gate")].T
            up = x @ w[layer_tensor(i, "ffn_up")].T
            h = h + (gate / (1 + np.exp(-gate)) * up) @ w[layer_tensor(i, "ffn_down")].T
        x = _rms(h, w["output_norm.weight"], cfg.norm_eps)
        return x @ w["token_embd.weight"].T
