"""The outcome of one benchmark request: what was sent and when each piece came back.

Times are seconds on the driver's monotonic clock, relative to the start of the measured
phase, so records from one run share one time axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Chunk:
    """One streamed response that carried output tokens."""

    time_s: float  # arrival, relative to the run's start
    num_tokens: int


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    class_name: str
    priority: int
    prompt_len: int
    expected_output_len: int
    send_s: float  # when the request was sent, relative to the run's start
    chunks: list[Chunk] = field(default_factory=list)
    done_s: float | None = None  # when the stream ended (success or error)
    # Tokens the server reported generating (usage), else the streamed count.
    output_tokens: int = 0
    # gRPC status code name ("UNAVAILABLE", ...) or "HTTP_503" / an exception name; None: ok.
    error: str | None = None
    error_message: str = ""
    # Where the server ran it, when it says (pdserve's trailing metadata: "pdserve-prefill"
    # local/remote/moved and the workers' addresses, without the "pdserve-" prefix).
    route: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        """The inverse of dataclasses.asdict: a record as `--save-records` wrote it."""
        return cls(**{**d, "chunks": [Chunk(**c) for c in d["chunks"]]})

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def ttft_s(self) -> float | None:
        """Time to the first chunk that carried a token."""
        if not self.chunks:
            return None
        return self.chunks[0].time_s - self.send_s

    @property
    def e2e_s(self) -> float | None:
        if self.done_s is None:
            return None
        return self.done_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output_tokens - 1): the mean time per token after the first.

        Undefined for a single output token; the decode phase did not exist.
        """
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.output_tokens < 2:
            return None
        return (e2e - ttft) / (self.output_tokens - 1)

    def itls_s(self) -> list[float]:
        """Inter-token latencies: each gap between chunks, spread over that chunk's tokens.

        A chunk of k tokens that arrived g seconds after the previous one contributes k
        values of g / k, so the ITL list has one entry per token after the first chunk
        and servers that batch tokens into chunks are not credited with zero gaps.
        """
        itls: list[float] = []
        for prev, cur in zip(self.chunks, self.chunks[1:]):
            gap = cur.time_s - prev.time_s
            itls.extend([gap / cur.num_tokens] * cur.num_tokens)
        return itls
