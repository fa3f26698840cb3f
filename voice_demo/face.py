"""The toy's terminal face: one small ASCII face per state.

On a terminal the face is redrawn in place (cursor up, clear to the end of the screen); anywhere else
(a pipe, a log file, CI) each state change is one plain line, ``[coco] listening``. Words (what the toy
heard and said) go under the face on a terminal, and as their own lines otherwise.

    face = Face("Coco", sys.stderr)
    face.show("thinking")
"""
from __future__ import annotations

import shutil
import threading

STATES = ("sleeping", "listening", "hearing", "thinking", "speaking")
# state -> (eyes, mouth, the mark beside the face, caption); eyes and mouth are 5 and 3 characters wide
LOOKS = {
    "sleeping": ("-   -", "___", "z Z", "{name} is asleep{hint}"),
    "listening": ("o   o", " - ", " ? ", "{name} is listening"),
    "hearing": ("O   O", " o ", ")))", "{name} hears you"),
    "thinking": ("o   ~", "...", " . ", "{name} is thinking"),
    "speaking": ("^   ^", "\\_/", "~~~", "{name} is talking"),
}


def render(state: str, name: str, hint: str = "") -> list[str]:
    """The face of ``state`` as lines of text (no trailing newlines)."""
    if state not in LOOKS:
        raise ValueError(f"unknown face state {state!r}; known: {', '.join(STATES)}")
    eyes, mouth, mark, caption = LOOKS[state]
    return ["   .-------.",
            f"  |  {eyes}  |  {mark}",
            f"  |   {mouth}   |",
            "   '-------'",
            "  " + caption.format(name=name, hint=f" ({hint})" if hint else "")]


class Face:
    """Shows the toy's state on ``stream``. Thread-safe: the voice loop's TTS thread calls it too."""

    def __init__(self, name: str, stream, tty: bool | None = None, hint: str = ""):
        self.name, self.stream, self.hint = name, stream, hint
        if tty is None:
            try:
                tty = stream.isatty()
            except (AttributeError, ValueError, OSError):
                tty = False
        self.tty = tty
        self.state: str | None = None
        self.words: list[str] = []  # the last lines of words, shown under the face on a tty
        self._drawn = 0  # lines drawn by the last redraw
        self._lock = threading.Lock()

    def show(self, state: str) -> None:
        with self._lock:
            if state == self.state:
                return
            render(state, self.name)  # refuses an unknown state before anything is drawn
            self.state = state
            if self.tty:
                self._redraw()
            else:
                print(f"[{self.name.lower()}] {state}", file=self.stream, flush=True)

    def say(self, line: str) -> None:
        """A line of words (``you: ...`` / ``coco: ...``)."""
        with self._lock:
            if self.tty:
                self.words = (self.words + [line])[-2:]
                self._redraw()
            else:
                print(line, file=self.stream, flush=True)

    def _redraw(self) -> None:
        lines = render(self.state or "sleeping", self.name, self.hint if self.state == "sleeping" else "")
        width = max(20, shutil.get_terminal_size((80, 24)).columns - 1)
        lines += [w if len(w) <= width else w[: width - 3] + "..." for w in self.words]  # one row each, or the
        #                                                          cursor-up count would miss wrapped rows
        up = f"\x1b[{self._drawn}F" if self._drawn else ""  # to the first line of the last drawing
        self.stream.write(up + "\x1b[J" + "\n".join(lines) + "\n")  # clear below, draw
        self.stream.flush()
        self._drawn = len(lines)

    def close(self) -> None:
        with self._lock:
            self._drawn = 0
