"""A GGUF's BPE vocabulary and merges, for the artifact and for the tests.

``bpe_file_text`` writes the artifact's ``tokenizer.bpe``, which runtime/tokenizer.py reads.
``build_tokenizer`` makes the same tokenizer with Hugging Face ``tokenizers`` (a dev
dependency): the second reference the tests compare the runtime's ids with, next to
llama.cpp's (tests/fixtures, made with llama-cpp-python). Pre-tokenizers are chosen by the
GGUF's ``tokenizer.ggml.pre`` name, as llama.cpp does.
"""
from __future__ import annotations

from .arch import TokenizerData

CONTROL, USER_DEFINED = 3, 4


def _pre_name(pre: str) -> str:
    """The GGUF's ``tokenizer.ggml.pre`` as one of the two pre-tokenizers boardtalk implements."""
    from runtime.tokenizer import PRE_TOKENIZERS

    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"pre-tokenizer {pre!r} is not supported yet (known: {', '.join(PRE_TOKENIZERS)})")
    return PRE_TOKENIZERS[pre]


def _pre_tokenizer(pre: str):
    from tokenizers import pre_tokenizers as pt

    bytelevel = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if _pre_name(pre) == "smollm":
        # llama.cpp: "\p{N}" (every digit alone), then the GPT-2 regex.
        return pt.Sequence([pt.Digits(individual_digits=True), bytelevel])
    return bytelevel


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


def bpe_file_text(tok: TokenizerData) -> str:
    """The artifact's tokenizer: the GGUF's vocabulary and merges as lines, read by runtime/tokenizer.py
    with a split() (about 20x faster to load than the same data as tokenizers JSON).

        boardtalk-bpe 1
        pre <smollm|gpt2>
        control <ids>         special tokens (matched only in template markup)
        user <ids>            user-defined added tokens (always matched)
        tokens <n>            then n lines: the byte-level pieces, in id order
        merges <m>            then m lines "left right", in rank order
    """
    from runtime.tokenizer import BPE_MAGIC

    pre = _pre_name(tok.pre)
    for s in tok.tokens:
        if "\n" in s:
            raise ValueError(f"token {s!r} contains a newline; the BPE file cannot hold it")
    for mg in tok.merges:
        if mg.count(" ") != 1 or "\n" in mg:
            raise ValueError(f"merge {mg!r} is not 'left right'")
    control = [i for i, t in enumerate(tok.token_types) if t == CONTROL]
    user = [i for i, t in enumerate(tok.token_types) if t == USER_DEFINED]
    lines = [BPE_MAGIC, f"pre {pre}", " ".join(["control"] + [str(i) for i in control]),
             " ".join(["user"] + [str(i) for i in user]), f"tokens {len(tok.tokens)}", *tok.tokens,
             f"merges {len(tok.merges)}", *tok.merges]
    return "\n".join(lines) + "\n"
