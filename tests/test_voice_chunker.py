"""The clause chunker: the first chunk ends at the first clause boundary with enough words, later ones at
sentence ends; abbreviations and numbers do not end sentences; nothing is lost or duplicated."""
import pytest

from runtime.voice.chunker import Chunker


def _chunks(text, step=3):
    c, out = Chunker(), []
    for i in range(0, len(text), step):  # deltas of a few characters, as tokens arrive
        out += c.push(text[i : i + step])
    return out + c.flush()


@pytest.mark.parametrize("text,want", [
    ("Well, the sky is blue because air scatters blue light. It is pretty!",
     ["Well, the sky is blue because air scatters blue light.", "It is pretty!"]),
    ("The sky looks blue, because sunlight scatters off air. Sunsets are red.",
     ["The sky looks blue,", "because sunlight scatters off air.", "Sunsets are red."]),
    ("Dr. Smith has 3.5 cats. Really.", ["Dr. Smith has 3.5 cats.", "Really."]),
    ("Yes!", ["Yes!"]),
    ("Hello there\nHow are you", ["Hello there", "How are you"]),
    ("...", []),
])
def test_chunks(text, want):
    assert _chunks(text) == want
    assert _chunks(text, step=1) == want


def test_nothing_lost_on_long_replies():
    text = ("Octopuses have three hearts, blue blood and nine brains; each arm can taste what it touches, "
            "and they change color in a fraction of a second. ") * 3
    got = _chunks(text, step=2)
    assert " ".join(got).split() == text.split()
    assert len(got[0].split()) <= 8  # the first chunk is a clause, not the sentence
