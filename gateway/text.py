"""Streaming text: incremental detokenization and stop strings (pure, no I/O).

Incremental detokenization follows vLLM's scheme: decode a short window twice, with and
without the newest tokens, and emit the difference once it no longer ends in an incomplete
UTF-8 sequence (U+FFFD), so a multi-byte character is never split across messages. The
decode itself runs in the tokenizer pool; this module keeps the offsets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"

# (ids, read_offset) -> (prefix_text, full_text): decodes ids[:read_offset] and ids.
DecodePair = Callable[[list[int], int], tuple[str, str]]


def decode_delta(prefix_text: str, full_text: str, final: bool) -> str | None:
    """The new text, or None while the window ends inside a character."""
    if len(full_text) > len(prefix_text) and (final or not full_text.endswith(REPLACEMENT)):
        return full_text[len(prefix_text):]
    return None


@dataclass(slots=True)
class Detokenizer:
    """Offsets into the generated ids: [prefix_offset, read_offset) is context already
    emitted, [read_offset, len) is not yet emitted."""

    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def window(self, new_ids: list[int]) -> tuple[list[int], int]:
        """Appends new ids; returns the ids to decode and the read offset within them."""
        self.token_ids.extend(new_ids)
        return self.token_ids[self.prefix_offset:], self.read_offset - self.prefix_offset

    def advance(self, delta: str | None) -> str:
        if delta is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return delta


@dataclass(slots=True)
class StopMatcher:
    """Holds back text that could be the start of a stop string, and cuts at the first one."""

    stops: tuple[str, ...]
    text: str = ""
    emitted: int = 0
    stopped: bool = False

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> str:
        """Adds new text; returns what is safe to send. Sets ``stopped`` at a stop string."""
        assert not self.stopped
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        if not self.stops:
            return self._emit_to(len(self.text))
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit_to(min(hits))
        return self._emit_to(len(self.text) - self.holdback)

    def flush(self) -> str:
        """Everything held back, once generation ended without a stop string."""
        return "" if self.stopped else self._emit_to(len(self.text))

    def _emit_to(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted:end], end
        return out
