"""Write a tiny random Llama GGUF (same architecture and file layout as SmolLM2) for fast unit tests.

    python tests/make_tiny_model.py OUT.gguf [--float]

Q4_1 linear weights and a Q8_0 tied embedding, as in the real SmolLM2 file (--float writes F32
weights instead, for the round-to-nearest quantizer). Byte-level BPE vocabulary: 3 control
tokens, the 256 byte symbols, a few merges. Deterministic for a given seed.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
CFG = dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn=128, rope_base=10000.0, eps=1e-5, ctx=512)


def _byte_symbols() -> list[str]:
    from runtime.tokenizer import _byte_decoder

    inv = {b: c for c, b in _byte_decoder().items()}
    return [inv[b] for b in range(256)]


def write_tiny_gguf(path: str | Path, seed: int = 0, float_weights: bool = False) -> Path:
    import gguf

    rng = np.random.default_rng(seed)
    c = CFG
    tokens = SPECIALS + _byte_symbols() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    V, C, F, H, KVH = len(tokens), c["hidden"], c["ffn"], c["n_heads"], c["n_kv_heads"]
    D = C // H
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    w.add_block_count(c["n_layers"])
    w.add_context_length(c["ctx"])
    w.add_embedding_length(C)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(c["rope_base"])
    w.add_layer_norm_rms_eps(c["eps"])
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)

    def tensor(name, rows, cols, qtype, scale):
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if float_weights or qtype is None:
            w.add_tensor(name, a)
        else:
            q = gguf.quants.quantize(a, qtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)

    Q41, Q80 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    tensor("token_embd.weight", V, C, Q80, 1.0)
    for i in range(c["n_layers"]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(C)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(C)).astype(np.float32))
        tensor(f"blk.{i}.attn_q.weight", H * D, C, Q41, 0.3)
        tensor(f"blk.{i}.attn_k.weight", KVH * D, C, Q41, 0.3)
        tensor(f"blk.{i}.attn_v.weight", KVH * D, C, Q41, 0.3)
        tensor(f"blk.{i}.attn_output.weight", C, H * D, Q41, 0.1)
        tensor(f"blk.{i}.ffn_gate.weight", F, C, Q41, 0.2)
        tensor(f"blk.{i}.ffn_up.weight", F, C, Q41, 0.2)
        tensor(f"blk.{i}.ffn_down.weight", C, F, Q41, 0.1)
    w.add_tensor("output_norm.weight", np.ones(C, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--float", action="store_true", help="F32 weights instead of Q4_1/Q8_0")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(write_tiny_gguf(a.out, a.seed, a.float))
