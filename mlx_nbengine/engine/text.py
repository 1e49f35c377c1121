"""Turning generated token ids into streamed text, with stop strings.

A `TextStream` wraps one request's streaming detokenizer (a copy from the mlx-lm
`TokenizerWrapper`). After each token it returns the *delta*: text that is final, i.e.
not a possible beginning of a stop string. When a stop string appears, the text is cut
just before it and the stream reports that it stopped (`stopped`) and which stop string
matched (`stop_matched`: the one that starts first). Owned by the generation thread.
"""

from __future__ import annotations


class TextStream:
    """Incremental text of one request; `text` is everything released so far."""

    def __init__(self, detokenizer, stop: list[str]) -> None:
        self._detok = detokenizer
        self._stop = [s for s in stop if s]
        self.text = ""
        self.stopped = False
        self.stop_matched: str | None = None

    def add(self, token: int) -> str:
        """Feed one token; return the newly released text (may be empty)."""
        self._detok.add_token(token)
        return self._release(self._detok.text, final=False)

    def finish(self) -> str:
        """Flush what the detokenizer held back; return the last delta."""
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._release(self._detok.text, final=True)

    def _release(self, full: str, *, final: bool) -> str:
        if self.stopped:
            return ""
        cut = len(full)
        for s in self._stop:
            # A stop string can only start in the part not yet released (minus overlap).
            at = full.find(s, max(0, len(self.text) - len(s) + 1))
            if at != -1 and at < cut:
                cut = at
                self.stopped = True
                self.stop_matched = s
        if not self.stopped and not final:
            cut -= self._held_back(full)
        cut = max(cut, len(self.text))
        delta = full[len(self.text) : cut]
        self.text = full[:cut]
        return delta

    def _held_back(self, full: str) -> int:
        # Longest suffix of `full` that is a proper prefix of some stop string.
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(full)), longest, -1):
                if full.endswith(s[:n]):
                    longest = n
                    break
        return longest
