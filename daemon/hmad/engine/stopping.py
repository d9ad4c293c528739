"""Stop strings over a token stream: emit text as soon as it cannot be part of a stop string.

Pieces arrive one token's text at a time, so a stop string may span many pieces, and one piece
may end one candidate and start another. The matcher keeps back only the longest tail that is
still a proper prefix of some stop string, so at most ``max(len(stop)) - 1`` characters wait.

Why that tail is enough: a stop string starting at position j of the text seen so far either
lies wholly inside it (``str.find`` sees it) or runs past its end, in which case ``text[j:]`` is a
proper prefix of that stop string. Everything before the longest such tail is therefore safe.

A hit ends the stream at once, at the piece that completes a stop string, cutting at the earliest
complete occurrence in the text so far. A longer stop string that started earlier but is still
only partial is not waited for: generation has already stopped (llama.cpp's server does the same).
"""

from __future__ import annotations


class StopMatcher:
    """Streams text through, cutting it at the first occurrence of any stop string.

    ``feed`` returns ``(safe_text, hit)``. On a hit, ``safe_text`` ends just before the stop string;
    the stop string and anything after it are never returned, and later ``feed``/``flush`` calls
    return nothing. ``matched`` names the stop string that hit. With no stop strings, every piece
    passes straight through.
    """

    def __init__(self, stops: list[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = list(dict.fromkeys(stops))  # de-duplicated, order kept
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._first_chars = frozenset(s[0] for s in self.stops)
        self._held = ""
        self.matched: str | None = None

    @property
    def hit(self) -> bool:
        return self.matched is not None

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add one piece of generated text; return the text now safe to emit and whether a stop hit."""
        if self.hit:
            return "", True
        if not self.stops:
            return piece, False
        text = self._held + piece
        cut, stop = self._first_match(text)
        if stop is not None:
            self._held, self.matched = "", stop
            return text[:cut], True
        hold_from = self._partial_start(text)
        self._held = text[hold_from:]
        return text[:hold_from], False

    def flush(self) -> str:
        """Release the held-back text at the end of generation (empty after a hit)."""
        held, self._held = self._held, ""
        return "" if self.hit else held

    def _first_match(self, text: str) -> tuple[int, str | None]:
        """(start, stop) of the earliest complete stop string in ``text``; (-1, None) when none."""
        best, best_stop = -1, None
        for stop in self.stops:
            i = text.find(stop)
            if i >= 0 and (best < 0 or i < best):
                best, best_stop = i, stop
        return best, best_stop

    def _partial_start(self, text: str) -> int:
        """Start of the longest tail of ``text`` that is a proper prefix of a stop; len(text) if none."""
        for j in range(max(0, len(text) - self._max_hold), len(text)):
            if text[j] in self._first_chars:
                tail = text[j:]
                if any(stop.startswith(tail) for stop in self.stops):
                    return j
        return len(text)
