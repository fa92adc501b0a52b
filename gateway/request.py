"""Turning a public GenerateRequest into a validated job (pure: no grpc, no I/O).

Every rule here answers INVALID_ARGUMENT with a message that names the field and says
what to change.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from gateway.queue import Priority
from pdserve.rpc import InvalidArgument
from protos import generation_pb2, worker_pb2

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_REQUEST_ID_LEN = 128
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 256
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool

    def to_engine(self, max_tokens: int) -> worker_pb2.EngineSampling:
        msg = worker_pb2.EngineSampling(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )
        if self.seed is not None:
            msg.seed = self.seed
        return msg


@dataclass(frozen=True, slots=True)
class Job:
    request_id: str
    # Exactly one of the three is set.
    prompt: str | None
    messages: tuple[tuple[str, str], ...] | None
    token_ids: tuple[int, ...] | None
    sampling: Sampling
    priority: Priority = Priority.INTERACTIVE
    # The request's own objectives in ms (0: none); None: its class's default.
    slo_ttft_ms: int | None = None
    slo_tpot_ms: int | None = None


def parse_request(req: generation_pb2.GenerateRequest) -> Job:
    request_id = req.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
    given = [name for name, present in (
        ("prompt", bool(req.prompt)),
        ("messages", len(req.messages) > 0),
        ("token_ids", len(req.token_ids) > 0),
    ) if present]
    if not given:
        raise InvalidArgument("the request has no input: set one of prompt, messages or token_ids")
    if len(given) > 1:
        raise InvalidArgument(f"set exactly one of prompt, messages or token_ids; got {' and '.join(given)}")
    messages = None
    if req.messages:
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(f"messages[{i}].role is {m.role!r}; use one of {', '.join(CHAT_ROLES)}")
        if all(not m.content for m in req.messages):
            raise InvalidArgument("every message's content is empty")
        messages = tuple((m.role, m.content) for m in req.messages)
    if req.prompt and not req.prompt.strip():
        raise InvalidArgument("prompt is only whitespace")
    return Job(
        request_id=request_id,
        prompt=req.prompt or None,
        messages=messages,
        token_ids=tuple(req.token_ids) or None,
        sampling=parse_sampling(req.sampling),
        priority=parse_priority(req.priority),
        slo_ttft_ms=req.slo.ttft_ms if req.slo.HasField("ttft_ms") else None,
        slo_tpot_ms=req.slo.tpot_ms if req.slo.HasField("tpot_ms") else None,
    )


def parse_priority(value: int) -> Priority:
    """The proto's Priority (UNSPECIFIED means interactive) as the queue's class."""
    if value == generation_pb2.PRIORITY_UNSPECIFIED:
        return Priority.INTERACTIVE
    names = [n for n in generation_pb2.Priority.keys() if n != "PRIORITY_UNSPECIFIED"]
    if value not in generation_pb2.Priority.values():
        raise InvalidArgument(f"priority {value} is not a known class; use one of {', '.join(names)}")
    return Priority[generation_pb2.Priority.Name(value).removeprefix("PRIORITY_")]


def parse_sampling(s: generation_pb2.SamplingParams) -> Sampling:
    max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_tokens < 1:
        raise InvalidArgument(f"sampling.max_tokens must be >= 1, got {max_tokens}")
    temperature = s.temperature if s.HasField("temperature") else DEFAULT_TEMPERATURE
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise InvalidArgument(f"sampling.temperature must be in [0, 2], got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else 1.0
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {top_p}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"sampling.stop has {len(s.stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, stop in enumerate(s.stop):
        if not 1 <= len(stop) <= MAX_STOP_LEN:
            raise InvalidArgument(f"sampling.stop[{i}] must be 1-{MAX_STOP_LEN} characters long")
    return Sampling(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=s.top_k if s.HasField("top_k") else 0,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
    )


def check_prompt_fits(
    prompt_ids: list[int], sampling: Sampling, max_model_len: int, vocab_size: int
) -> None:
    """Rules that need the tokenized prompt and the model's limits."""
    if not prompt_ids:
        raise InvalidArgument("the prompt tokenizes to nothing; send some text")
    too_big = next((t for t in prompt_ids if t >= vocab_size), None)
    if too_big is not None:
        raise InvalidArgument(f"token id {too_big} is outside the vocabulary (size {vocab_size})")
    for t in sampling.stop_token_ids:
        if t >= vocab_size:
            raise InvalidArgument(f"sampling.stop_token_ids has {t}, outside the vocabulary (size {vocab_size})")
    if len(prompt_ids) >= max_model_len:
        raise InvalidArgument(
            f"the prompt has {len(prompt_ids)} tokens; the model's context is {max_model_len} tokens"
        )
    if len(prompt_ids) + sampling.max_tokens > max_model_len:
        raise InvalidArgument(
            f"prompt ({len(prompt_ids)} tokens) + sampling.max_tokens ({sampling.max_tokens}) exceeds "
            f"the model's context of {max_model_len}; lower max_tokens to at most "
            f"{max_model_len - len(prompt_ids)}"
        )
