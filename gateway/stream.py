"""One Generate call's output: new token ids in, GenerateResponse messages out.

The servicer calls Stream.reply once per batch of new ids (the first token from prefill,
then each DecodeResponse) and sends what it returns. A reply:
  1. Detokenizes the new ids incrementally, in this process (text.IncrementalDecoder): a
     round trip to the tokenizer pool per message cost more CPU than the decode itself.
  2. Cuts the text at the first stop string, holding back what could start one.
  3. Counts tokens and reports latencies to the observer (TTFT, ITL, E2E).
  4. On the last message (a finish reason), carries the usage.
Synchronous and free of grpc and asyncio: the caller owns the call and its timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from tokenizers import Tokenizer

from gateway import metrics
from gateway.request import Job
from gateway.text import IncrementalDecoder, StopMatcher
from protos import generation_pb2


class Observer(Protocol):
    """Where a stream reports its latencies; the job says which request (and class) it is."""

    def first_token(self, job: Job, ttft_s: float) -> None: ...

    def tokens(self, job: Job, num_tokens: int, gap_s: float) -> None: ...

    def finished(self, job: Job, e2e_s: float, num_prompt_tokens: int, num_generated: int) -> None: ...


class PrometheusObserver:
    """The gateway's vLLM-named histograms and counters (gateway.metrics)."""

    def first_token(self, job: Job, ttft_s: float) -> None:
        metrics.TTFT.observe(ttft_s)

    def tokens(self, job: Job, num_tokens: int, gap_s: float) -> None:
        # Tokens that arrive together share the gap since the last message, as in vLLM.
        per_token = gap_s / num_tokens
        for _ in range(num_tokens):
            metrics.ITL.observe(per_token)

    def finished(self, job: Job, e2e_s: float, num_prompt_tokens: int, num_generated: int) -> None:
        metrics.E2E.observe(e2e_s)
        metrics.PROMPT_TOKENS.inc(num_prompt_tokens)
        metrics.GENERATION_TOKENS.inc(num_generated)


PROMETHEUS = PrometheusObserver()


class ClassObserver(PrometheusObserver):
    """One request's observer: the vLLM-named metrics, the same by class, and on finishing
    whether the request met its objectives (pdserve_slo_requests_total)."""

    __slots__ = ("label", "ttft_slo_s", "tpot_slo_s", "ttft_s", "_itl")

    def __init__(self, label: str, ttft_slo_s: float | None, tpot_slo_s: float | None) -> None:
        self.label = label
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.ttft_s: float | None = None
        self._itl = metrics.CLASS_ITL.labels(label)  # once per stream, not per message

    def first_token(self, job: Job, ttft_s: float) -> None:
        super().first_token(job, ttft_s)
        metrics.CLASS_TTFT.labels(self.label).observe(ttft_s)
        self.ttft_s = ttft_s

    def tokens(self, job: Job, num_tokens: int, gap_s: float) -> None:
        super().tokens(job, num_tokens, gap_s)
        per_token = gap_s / num_tokens
        for _ in range(num_tokens):
            self._itl.observe(per_token)

    def finished(self, job: Job, e2e_s: float, num_prompt_tokens: int, num_generated: int) -> None:
        super().finished(job, e2e_s, num_prompt_tokens, num_generated)
        metrics.observe_finished(self.label, e2e_s, self.ttft_s, num_generated, self.ttft_slo_s, self.tpot_slo_s)


@dataclass(slots=True)
class Stream:
    """One call's output state: decoder, stop strings, counts, timings."""

    job: Job
    num_prompt_tokens: int
    tokenizer: Tokenizer
    observer: Observer = PROMETHEUS
    # When the request reached the gateway (time.monotonic()).
    started: float = field(default_factory=time.monotonic)
    decoder: IncrementalDecoder = field(init=False)
    stop: StopMatcher = field(init=False)
    last_sent: float | None = None
    num_generated: int = 0

    def __post_init__(self) -> None:
        self.decoder = IncrementalDecoder(self.tokenizer)
        self.stop = StopMatcher(self.job.sampling.stop)

    @property
    def stopped(self) -> bool:
        """A stop string was found: the last reply has been built; send no more."""
        return self.stop.stopped

    def reply(self, new_ids: list[int], finish_reason: str) -> generation_pb2.GenerateResponse:
        """The message for new_ids; finish_reason "" while the engine goes on.

        The reply's finish_reason is "stop" when a stop string cut the text, so the caller
        ends the call once reply.finish_reason is set.
        """
        assert not self.stop.stopped, "reply() after a stop string ended the stream"
        text = self.stop.feed(self.decoder.step(new_ids, final=bool(finish_reason)))
        if self.stop.stopped:
            finish_reason = "stop"
        elif finish_reason:
            text += self.stop.flush()
        self.num_generated += len(new_ids)
        reply = generation_pb2.GenerateResponse(
            request_id=self.job.request_id, text=text, token_ids=new_ids, finish_reason=finish_reason
        )
        now = time.monotonic()
        self._observe(len(new_ids), now)
        if finish_reason:
            reply.usage.prompt_tokens = self.num_prompt_tokens
            reply.usage.completion_tokens = self.num_generated
            self.observer.finished(self.job, now - self.started, self.num_prompt_tokens, self.num_generated)
        return reply

    def _observe(self, num_tokens: int, now: float) -> None:
        if self.last_sent is None:
            self.observer.first_token(self.job, now - self.started)
        elif num_tokens:
            self.observer.tokens(self.job, num_tokens, now - self.last_sent)
        self.last_sent = now
