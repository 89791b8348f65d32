"""Stop strings over streamed text: what may be sent now, and whether a stop string was found.

The engine feeds each token's new text; a stop string can span tokens, so text that could be the
start of one waits until the next text decides (only as many characters as the longest prefix of a
stop string that the text ends with: other text goes out at once, which keeps time to first token
unchanged for outputs that never come close to a stop string). The stop string itself and everything
after it are never sent, as in vLLM and OpenAI.
"""

from __future__ import annotations


class StopStrings:
    """Incremental matcher of one request's stop strings (``feed`` new text, ``flush`` at the end)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = stops
        self._longest = max(len(s) for s in stops)
        self._pending = ""

    def _held(self, text: str) -> int:
        """Characters at the end of ``text`` that are a proper prefix of some stop string."""
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text to send now, the stop string found or None); after a match, nothing more is sent."""
        buf = self._pending + text
        found: tuple[int, str] | None = None
        for stop in self._stops:
            at = buf.find(stop)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is not None:
            self._pending = ""
            return buf[: found[0]], found[1]
        held = self._held(buf)
        self._pending = buf[len(buf) - held:] if held else ""
        return buf[: len(buf) - held], None

    def flush(self) -> str:
        """What was held back, when generation ended for another reason (it matched no stop string)."""
        text, self._pending = self._pending, ""
        return text
