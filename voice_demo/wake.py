"""Wake phrase matching on the ASR transcript, and the gate that puts it between the ASR and the LLM.

    match_wake("Hey, Coco! What color is the sky?", "hey coco")  -> "What color is the sky?"
    match_wake("What color is the sky?", "hey coco")              -> None

The phrase is looked for among the first words of what was heard (case, punctuation and small ASR slips
ignored: "Hey, Koko" matches "hey coco"; the words must both look and sound like it, so "Hey, look" and
"Hey Coach" do not); the rest of the utterance after it is the question. There is no
separate keyword-spotting model: the voice loop's own ASR hears the phrase, so a wake costs nothing extra,
but every utterance is transcribed (and then dropped when it has no phrase: nothing is kept).

``WakeGate`` wraps the loop's ASR engine (runtime/voice/pipeline.py is used unchanged): an utterance without
the phrase, while the toy is asleep, transcribes to "" and the loop answers nothing; with it, the loop
sees only the question. Partial passes go through the same gate, so a sleeping toy prefills nothing either.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from difflib import SequenceMatcher

from runtime.voice.engines import Transcript

log = logging.getLogger(__name__)  # transcripts only at DEBUG (-vv): nothing heard is logged by default

WORD = re.compile(r"[A-Za-z0-9]+(?:'[A-Za-z]+)?")
MAX_OFFSET = 2  # the phrase may start after at most this many words ("oh, hey coco ...", "um hey coco")


def _norm(words: list[str]) -> str:
    return " ".join(w.lower().replace("'", "") for w in words)


def _metaphone():
    try:
        from jellyfish import metaphone
    except ImportError:
        raise ImportError("wake phrase matching needs jellyfish: pip install 'boardtalk[voice]'") from None
    return metaphone


def similarity(heard_words: list[str], phrase: str) -> float:
    """How much the words heard look AND sound like the phrase, 0..1: the lower of difflib's ratio over the
    lowercased words and over their Metaphone codes (the words joined, so that an ASR's splits and merges,
    "Co co" / "Heycoco", still sound the same). Spelling alone lets "Hey, look" or "Hey Coach" pass for
    "hey coco" (both 0.75 or more); sound alone lets "Hey, go get" pass (Metaphone "HKKT" vs "HKK")."""
    metaphone = _metaphone()
    got, want = _norm(heard_words), _norm(phrase.split())
    spell = SequenceMatcher(None, got, want).ratio()
    a, b = metaphone(got.replace(" ", "")), metaphone(want.replace(" ", ""))
    sound = SequenceMatcher(None, a, b).ratio() if b else spell  # a phrase of digits has no Metaphone code
    return min(spell, sound)


def match_wake(text: str, phrase: str, threshold: float = 0.75) -> str | None:
    """The question after the wake phrase ("" when the phrase was all), or None when ``text`` does not start
    (within MAX_OFFSET words) with something at least ``threshold`` similar (``similarity``) to ``phrase``;
    windows one word shorter and longer than the phrase are tried too. threshold 1: the exact words only."""
    m = _match(text, phrase, threshold)
    return None if m is None else m[0]


# Once a pass over an utterance has heard the wake phrase, a later pass over the same audio only has to say
# where the (misheard) phrase ends: a looser match, else as many words as the first pass's phrase took.
LOOSE_THRESHOLD = 0.5


def _after_vocative(text: str, within: int) -> str | None:
    """The text after the first comma/stop/!/? that follows one of its first ``within`` words ("Hey go go,
    what ...": Whisper marks a name called out with a comma), or None."""
    for i, m in enumerate(list(WORD.finditer(text))[:within]):
        if text[m.end():m.end() + 1] in (",", ".", "!", "?"):
            return after_words(text, i + 1)
    return None


def after_words(text: str, k: int) -> str:
    """text without its first k words (and the punctuation after them)."""
    toks = list(WORD.finditer(text))
    if k <= 0 or not toks:
        return text.strip()
    return text[toks[min(k, len(toks)) - 1].end():].lstrip(" \t,.;:!?-").strip()


def _match(text: str, phrase: str, threshold: float) -> tuple[str, int] | None:
    """(the question after the phrase, how many words up to the phrase's end) or None."""
    n = len(phrase.split())
    want = _norm(phrase.split())
    toks = list(WORD.finditer(text))
    best, end = 0.0, None
    for start in range(0, min(MAX_OFFSET, len(toks)) + 1):
        for size in (n - 1, n, n + 1):
            if size < 1 or start + size > len(toks):
                continue
            words = [m.group(0) for m in toks[start : start + size]]
            r = 1.0 if _norm(words) == want else (similarity(words, phrase) if threshold < 1 else 0.0)
            if r > best:  # ties: the earliest, shortest window wins
                best, end = r, start + size - 1
    if end is None or best < threshold:
        return None
    return after_words(text, end + 1), end + 1


@dataclass
class Heard:
    """What the gate made of the latest pass over the current utterance."""
    raw: str = ""  # what the ASR heard
    question: str = ""  # what the loop was given ("" = nothing to answer)
    woke: bool = False  # the wake phrase was in it (in this pass or an earlier pass over the utterance)
    wake_words: int = 0  # words up to the phrase's end, in the pass that found it
    awake: bool = False  # the toy was already listening when the utterance began (follow-up, push-to-talk)


class WakeGate:
    """An ASR engine for VoiceLoop: the wrapped engine's transcript, less the wake phrase; "" when the toy is
    asleep and the phrase is not there. ``phrase=None``: no wake phrase (push-to-talk): everything passes.

    begin(awake) is called (main thread) when an utterance starts; transcribe() runs on the loop's ASR
    thread, the latest call of an utterance is its final pass."""

    def __init__(self, asr, phrase: str | None, threshold: float = 0.75):
        self.asr, self.phrase, self.threshold = asr, phrase, threshold
        self.name = getattr(asr, "name", "?")
        self._lock = threading.Lock()
        self.heard = Heard()

    def begin(self, awake: bool) -> None:
        with self._lock:
            self.heard = Heard(awake=awake)

    def forget(self) -> None:
        with self._lock:
            self.heard = Heard(awake=self.heard.awake)

    def reset(self) -> None:
        self.asr.reset()

    def warmup(self) -> None:
        self.asr.warmup()

    def transcribe(self, audio) -> Transcript:
        with self._lock:
            heard = self.heard  # this utterance's record, even if the next one begins meanwhile
        tr = self.asr.transcribe(audio)
        raw = tr.text.strip()
        m = _match(raw, self.phrase, self.threshold) if self.phrase else None
        if m is not None:
            q, heard.wake_words = m
            woke = True
        elif heard.woke:  # an earlier pass over this utterance heard the phrase; this one misheard it ("Hey
            woke = True   # Coco" then "Hey go go, what color ...": CI saw it): where is it, roughly?
            q = _after_vocative(raw, len(self.phrase.split()) + 1)
            if q is None:
                loose = _match(raw, self.phrase, LOOSE_THRESHOLD)
                q = loose[0] if loose is not None else after_words(raw, heard.wake_words)
        else:
            woke = False
            q = raw if heard.awake or self.phrase is None else ""
        heard.raw, heard.question, heard.woke = raw, q, woke
        log.debug("heard %r: %s", raw, "woke" if woke else "passed" if q else "ignored (asleep, no wake phrase)")
        return Transcript(text=q, seconds=tr.seconds, audio_s=tr.audio_s, segments=[] if not q else tr.segments)
