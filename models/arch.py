"""Model architectures and reading a GGUF into one.

An architecture is a frozen config dataclass plus the tensor names it needs. Only
the Llama family (SmolLM2) is registered so far; a new one is a new config and a
registry entry.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.config import ModelConfig, rope_tables  # noqa: F401  (re-exported for the builders)

log = logging.getLogger(__name__)


# The config lives on the board side (runtime/config.py), which validates it; the builder fills it from a GGUF.
LlamaConfig = ModelConfig
ARCHITECTURES = {"llama": LlamaConfig}


@dataclass
class TokenizerData:
    tokens: list[str]
    token_types: list[int]  # GGUF token types: 1 normal, 3 control, 4 user-defined, 6 byte
    merges: list[str]
    pre: str  # llama.cpp pre-tokenizer name, e.g. "smollm"
    bos_id: int | None
    eos_id: int
    add_bos: bool
    chat_template: str | None


@dataclass
class GGUFModel:
    """What a GGUF holds, read lazily: tensors stay memory-mapped until asked for."""

    path: Path
    name: str
    config: LlamaConfig
    tokenizer: TokenizerData
    tensors: dict[str, Any] = field(repr=False)  # name -> gguf ReaderTensor

    def raw(self, name: str) -> tuple[str, np.ndarray]:
        """(ggml type name, raw block bytes shaped (rows, bytes_per_row)) of one tensor."""
        t = self.tensors[name]
        return t.tensor_type.name, np.asarray(t.data)

    def dequantized(self, name: str) -> np.ndarray:
        """Float32 weights (rows, cols) as gguf's reference dequantizer computes them."""
        import gguf

        t = self.tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_gguf(path: str | Path) -> GGUFModel:
    try:
        import gguf
    except ImportError as e:  # pragma: no cover
        raise ImportError("reading GGUF needs the 'gguf' package: pip install gguf") from e
    path = Path(path)
    try:
        r = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    arch = _field(r, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (known: {', '.join(ARCHITECTURES)})")
    p = arch + "."
    hidden = int(_field(r, p + "embedding_length"))
    n_heads = int(_field(r, p + "attention.head_count"))
    tensors = {t.name: t for t in r.tensors}
    tokens = list(_field(r, "tokenizer.ggml.tokens"))
    cfg = LlamaConfig(
        n_layers=int(_field(r, p + "block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=int(_field(r, p + "attention.head_count_kv", n_heads)),
        head_dim=int(_field(r, p + "rope.dimension_count", hidden // n_heads)),
        ffn=int(_field(r, p + "feed_forward_length")),
        vocab=int(_field(r, p + "vocab_size", len(tokens))),
        rope_base=float(_field(r, p + "rope.freq_base", 10000.0)),
        norm_eps=float(_field(r, p + "attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in tensors,
        context_length=int(_field(r, p + "context_length", 2048)),
    )
    if _field(r, "tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{path}: tokenizer model {_field(r, 'tokenizer.ggml.model')!r} not supported (need gpt2 BPE)")
    tok = TokenizerData(
        tokens=tokens,
        token_types=[int(x) for x in _field(r, "tokenizer.ggml.token_type", [1] * len(tokens))],
        merges=list(_field(r, "tokenizer.ggml.merges", [])),
        pre=str(_field(r, "tokenizer.ggml.pre", "default")),
        bos_id=_field(r, "tokenizer.ggml.bos_token_id"),
        eos_id=int(_field(r, "tokenizer.ggml.eos_token_id")),
        add_bos=bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(r, "tokenizer.chat_template"),
    )
    name = str(_field(r, "general.name", path.stem))
    return GGUFModel(path=path, name=name, config=cfg, tokenizer=tok, tensors=tensors)


def layer_tensor(layer: int, what: str) -> str:
    """GGUF tensor name of one per-layer weight: attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down, attn_norm, ffn_norm."""
    return f"blk.{layer}.{what}.weight"
