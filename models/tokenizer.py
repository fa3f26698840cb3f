"""Build a Hugging Face ``tokenizers`` JSON from a GGUF's BPE vocabulary and merges.

The result must split text exactly as llama.cpp does (tests/fixtures hold reference
ids made with llama-cpp-python). Pre-tokenizers are chosen by the GGUF's
``tokenizer.ggml.pre`` name, as llama.cpp does.
"""
from __future__ import annotations

from .arch import TokenizerData

CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str):
    from tokenizers import pre_tokenizers as pt

    bytelevel = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "codeshell"):
        # llama.cpp: "\p{N}" (every digit alone), then the GPT-2 regex.
        return pt.Sequence([pt.Digits(individual_digits=True), bytelevel])
    if pre in ("default", "gpt-2", "gpt2"):
        return bytelevel
    raise ValueError(f"pre-tokenizer {pre!r} is not supported yet (known: smollm, gpt2)")


def build_tokenizer(tok: TokenizerData):
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(tok.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in tok.merges]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    t.pre_tokenizer = _pre_tokenizer(tok.pre)
    t.decoder = decoders.ByteLevel()
    special = [AddedToken(s, special=True, normalized=False) for s, ty in zip(tok.tokens, tok.token_types) if ty == CONTROL]
    user = [AddedToken(s, special=False, normalized=False) for s, ty in zip(tok.tokens, tok.token_types) if ty == USER_DEFINED]
    t.add_special_tokens(special)
    if user:
        t.add_tokens(user)
    return t


def stop_ids(tok: TokenizerData) -> list[int]:
    """Ids that end a reply: eos plus the usual end-of-turn control tokens present in the vocabulary."""
    ids = {tok.eos_id}
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        if name in tok.tokens:
            i = tok.tokens.index(name)
            if tok.token_types[i] == CONTROL:
                ids.add(i)
    return sorted(ids)
