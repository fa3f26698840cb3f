"""The model's architecture config, as the board reads it from a manifest, and the tables derived from it.

``ModelConfig.from_dict`` is the one place an architecture is checked: every field's type and
range, and how the fields combine (heads x head_dim = hidden, ...). Unknown keys are kept aside
in ``extra`` (written back unchanged), so a newer builder's additions do not break an older
board, and a missing or mistyped key is a one-line error naming it, never a KeyError.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

# Inclusive ranges: wide enough for any model this runtime may meet on a board, narrow enough that a
# corrupt or hostile number (n_layers: 1000000000) is refused before anything is sized from it.
LIMITS: dict[str, tuple[int, int]] = {
    "n_layers": (1, 256),
    "hidden": (1, 32768),
    "n_heads": (1, 256),
    "n_kv_heads": (1, 256),
    "head_dim": (2, 512),
    "ffn": (1, 262144),
    "vocab": (1, 1 << 21),
    "context_length": (1, 1 << 21),
}
ARCHITECTURES = ("llama",)


class ConfigError(ValueError):
    """An architecture config that is missing a field, mistyped, out of range or inconsistent."""


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    hidden: int  # residual width
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int
    ffn: int  # SwiGLU inner width
    vocab: int
    rope_base: float  # RoPE theta; adjacent pairs (x[2i], x[2i+1]) rotated ("normal", GGUF llama)
    norm_eps: float  # RMSNorm epsilon
    tie_embeddings: bool  # output layer = token embedding
    context_length: int  # what the model was trained for; an artifact may use less
    architecture: str = "llama"
    extra: dict = field(default_factory=dict, compare=False)  # unknown keys, kept aside

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d.update(self.extra)
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "architecture") -> "ModelConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a mapping, found {type(d).__name__}")
        known = {f.name for f in fields(cls)} - {"extra"}
        missing = sorted(k for k in known if k not in d and k != "architecture")
        if missing:
            raise ConfigError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
        try:
            return cls(**{k: v for k, v in d.items() if k in known},
                       extra={k: v for k, v in d.items() if k not in known})
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


def _validate(c: ModelConfig) -> None:
    """Types and ranges of every field, then the rules that tie them together."""
    for name, (lo, hi) in LIMITS.items():
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{name} should be an integer, found {type(v).__name__} {v!r:.40}")
        if not lo <= v <= hi:
            raise ConfigError(f"{name} = {v} is out of range [{lo}, {hi}]")
    for name, lo, hi in (("rope_base", 1.0, 1e9), ("norm_eps", 1e-12, 0.1)):
        v = getattr(c, name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not lo <= v <= hi:
            raise ConfigError(f"{name} = {v!r:.40} is not a number in [{lo:g}, {hi:g}]")
    if not isinstance(c.tie_embeddings, bool):
        raise ConfigError(f"tie_embeddings should be true or false, found {c.tie_embeddings!r:.40}")
    if c.architecture not in ARCHITECTURES:
        raise ConfigError(f"architecture {c.architecture!r:.40} is not supported (known: {', '.join(ARCHITECTURES)})")
    if c.n_heads * c.head_dim != c.hidden:
        raise ConfigError(f"n_heads x head_dim = {c.n_heads} x {c.head_dim} = {c.n_heads * c.head_dim} != hidden {c.hidden}")
    if c.n_heads % c.n_kv_heads:
        raise ConfigError(f"n_heads {c.n_heads} is not a multiple of n_kv_heads {c.n_kv_heads}")
    if c.head_dim % 2:
        raise ConfigError(f"head_dim {c.head_dim} must be even for RoPE")


def rope_tables(cfg: ModelConfig, n_pos: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (n_pos, head_dim/2) float32 of positions first..first+n_pos-1 (adjacent-pair RoPE).
    The native kernels and the ONNX graph use the same tables."""
    half = cfg.head_dim // 2
    inv = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim)
    ang = np.arange(first, first + n_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_rotate(x: np.ndarray, delta: int, cfg: ModelConfig) -> np.ndarray:
    """Rotate already-embedded keys x (..., head_dim) float by ``delta`` positions (negative: back),
    in float64: RoPE of position p followed by this is RoPE of position p + delta."""
    half = cfg.head_dim // 2
    inv = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.head_dim)
    c, s = np.cos(delta * inv), np.sin(delta * inv)
    a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
    out = np.empty(x.shape, np.float64)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out
