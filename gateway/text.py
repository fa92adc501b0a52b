"""Streaming text: incremental detokenization and stop strings (pure, no I/O).

Incremental detokenization follows vLLM's scheme: decode a short window twice, with and
without the newest tokens, and emit the difference once it no longer ends in an incomplete
UTF-8 sequence (U+FFFD), so a multi-byte character is never split across messages; the
last message of a stream emits whatever is left, U+FFFD included.

IncrementalDecoder runs that scheme in the gateway process on the tokenizers library's
DecodeStream, which implements the same windows in Rust and caches the shorter decode.
Detokenizer and decode_delta are the same scheme in Python; IncrementalDecoder falls back
to them for a stream whose decoder is not prefix-stable (DecodeStream raises there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"


def load_tokenizer(model: str | Path) -> Tokenizer:
    """The model folder's fast tokenizer (tokenizer.json), for decoding in this process."""
    path = Path(model).expanduser() / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the gateway detokenizes with the model's fast tokenizer; "
            "save one with transformers' AutoTokenizer.from_pretrained(...).save_pretrained(folder)"
        )
    return Tokenizer.from_file(str(path))


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


class IncrementalDecoder:
    """One stream's text, token ids in, new text out; special tokens are skipped.

    DecodeStream keeps its window private, so the same window is mirrored here: the final
    message needs it to emit a trailing incomplete character (DecodeStream only ever
    returns None there), and the fallback needs it to carry on where DecodeStream stopped.
    """

    __slots__ = ("_tokenizer", "_stream", "_window", "_read_offset")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=True)
        self._window: list[int] = []  # ids from the prefix offset on
        self._read_offset = 0  # within _window: ids before it are already emitted

    def step(self, new_ids: list[int], final: bool) -> str:
        """The text that new_ids complete; with final, everything not yet emitted."""
        self._window.extend(new_ids)
        text = None
        if self._stream is not None:
            try:
                text = self._stream.step(self._tokenizer, new_ids)
            except Exception:  # noqa: BLE001 - DecodeStreamError is not exported to Python
                # The window's text no longer starts with its prefix's: from here on decode
                # both windows each time and slice, as the gateway always did before.
                self._stream = None
        if self._stream is None or (text is None and final):
            prefix = self._decode(self._window[:self._read_offset])
            text = decode_delta(prefix, self._decode(self._window), final)
        if text is None:
            return ""
        del self._window[:self._read_offset]
        self._read_offset = len(self._window)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


@dataclass(slots=True)
class StopMatcher:
    """Holds back text that could be the start of a stop string, and cuts at the first one.
    Without stop strings it keeps nothing: each delta is sent as it comes."""

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
        if not self.stops:  # nothing to hold back or search: the text passes as it is
            return delta
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
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
