"""The content guard: a word filter on the toy's replies, between the LLM and the TTS.

What it does: every reply chunk (a clause or a sentence, as the voice loop's chunker cuts them) is checked
against voice_demo/blocklist.txt plus the persona's ``guard.extra_words`` (whole words, case-insensitive,
``word*`` = any ending). A chunk with a blocked word is not spoken: the persona's ``guard.redirect`` line is
said instead, once, and the rest of that reply is dropped. The text the conversation remembers is what was
spoken.

What it does not do: understand meaning (a harmful answer in innocent words passes; an innocent one with a
listed word is cut), check what the child said, or replace the system prompt, which asks the model to stay
child-friendly in the first place. A 135M model does not reliably follow its prompt: the list is the backstop.
"""
from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np

BLOCKLIST = Path(__file__).parent / "blocklist.txt"


def load_words(path: Path = BLOCKLIST) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [w.strip() for w in lines if w.strip() and not w.lstrip().startswith("#")]


def compile_blocklist(words) -> re.Pattern | None:
    """One regex for all words: whole words, spaces as any whitespace/punctuation run, ``*`` = any ending."""
    alts = []
    for w in words:
        w = w.strip().lower()
        star = w.endswith("*")
        parts = [re.escape(p) for p in w.rstrip("*").split()]
        if parts:
            alts.append(r"[\s,.;:!?'\"-]+".join(parts) + (r"\w*" if star else ""))
    if not alts:
        return None
    return re.compile(r"(?<!\w)(?:" + "|".join(sorted(alts, key=len, reverse=True)) + r")(?!\w)", re.IGNORECASE)


class ContentGuard:
    def __init__(self, extra_words=(), redirect: str = "Let's talk about something else!", path: Path = BLOCKLIST):
        self.pattern = compile_blocklist([*load_words(path), *extra_words])
        self.redirect = redirect

    def blocked(self, text: str) -> str | None:
        """The first blocked word in text, or None."""
        m = self.pattern.search(text) if self.pattern else None
        return m.group(0) if m else None


class GuardedTTS:
    """A TTS engine for VoiceLoop: the wrapped engine, speaking only chunks the guard lets through.

    new_reply() (main thread, when an utterance starts) resets the per-reply state; synthesize() runs on the
    loop's TTS thread. ``spoken`` is the text really said in the current reply, in order."""

    def __init__(self, tts, guard: ContentGuard):
        self.tts, self.guard = tts, guard
        self.name, self.sample_rate = getattr(tts, "name", "?"), tts.sample_rate
        self._lock = threading.Lock()
        self.new_reply()

    def new_reply(self) -> None:
        with self._lock:
            self.spoken: list[str] = []
            self.blocked: list[str] = []  # the blocked words met in this reply

    def warmup(self) -> None:
        self.tts.warmup()

    def synthesize(self, text: str) -> np.ndarray:
        word = self.guard.blocked(text)
        with self._lock:
            if self.blocked:  # the reply went somewhere it should not: say nothing more of it
                if word:
                    self.blocked.append(word)
                return np.zeros(0, np.float32)
            if word:
                self.blocked.append(word)
                text = self.guard.redirect
            self.spoken.append(text)
        return self.tts.synthesize(text)
