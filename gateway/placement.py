"""Placement: where a request's prompt is prefilled, and which decode worker runs it (pure).

Conditional disaggregation: a prompt is prefilled on a decode worker itself ("local") when
that gives its first token sooner than the trip through the prefill tier ("remote") and the
decode worker's running requests can absorb the stall without missing their TPOT
objectives: short prompts, an idle decode engine, a backed-up prefill tier. Long prompts
go to the prefill tier, which keeps them from disturbing decode, unless it would miss their
TTFT objective and a decode worker would meet it within its running requests' slack
("rescue", up to `PlacementConfig.rescue_prefill_max_tokens`): with both engines on the same
cores, the prefill engine runs at idle priority and crawls beside a busy decode engine (seen
in the long benchmark: a 663-token prompt sent beside one decoding request took 4.6-5.3 s to
its first token, where colocated vLLM took 0.78 s); the decode engine then prefills it as a
colocated engine would, stalling its running requests by no more than they can absorb.

Remote: a prefill worker takes work only while the prompt tokens sent to it and not yet
answered stay within a budget (one prompt is always allowed on an idle worker), so the
order the gateway chooses is the order the engines run. Among workers with room, the
soonest predicted finish wins; prompt tokens a worker's prefix cache likely holds (it
prefilled the same leading blocks recently) do not count as work there.

Decode: the worker with a free seat and KV room that runs the fewest requests (then the
lowest KV use).

No tier: while no prefill worker is in rotation, the decode workers prefill every prompt
(`place_without_tier`), so the service degrades to colocated serving instead of refusing.

Moved: a remote prefill of a prompt a decode worker could take, that has not answered
within twice its predicted time, is taken back and prefilled on a decode worker. With
both engines on the same cores, the prefill engine runs at idle priority and a decode
engine that never idles keeps it off them: seen in a closed loop of 6 short requests, a
prompt sent to the prefill tier waited 50 s for its first token.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace
from enum import Enum


class Where(str, Enum):
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class PlacementConfig:
    # Prompt tokens a prefill worker may hold sent but unanswered (beyond one prompt).
    prefill_queue_tokens: int = 1024
    # Longest prompt a decode worker may prefill itself; 0: always the prefill tier.
    local_prefill_max_tokens: int = 256
    # Longest prompt a decode worker may prefill itself when the prefill tier would miss its
    # TTFT objective (within the running requests' slack); 0: none beyond the limit above.
    rescue_prefill_max_tokens: int = 4096
    # A remote prefill is stalled once it runs this many times its predicted time, and
    # never before stall_min_s (stall_unknown_s when nothing predicted it).
    stall_factor: float = 2.0
    stall_min_s: float = 0.25
    stall_unknown_s: float = 1.0
    # The longest a request waits for a decode worker whose running requests of a higher
    # priority its joining would make miss their TPOT objectives (`join_slack_s`); 0: never.
    priority_hold_s: float = 5.0

    def __post_init__(self) -> None:
        if self.prefill_queue_tokens < 1:
            raise ValueError(f"prefill queue budget must be >= 1 token, got {self.prefill_queue_tokens}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"local prefill limit must be >= 0, got {self.local_prefill_max_tokens}")
        if self.rescue_prefill_max_tokens < 0:
            raise ValueError(f"rescue prefill limit must be >= 0, got {self.rescue_prefill_max_tokens}")
        if self.priority_hold_s < 0:
            raise ValueError(f"priority hold must be >= 0 s, got {self.priority_hold_s}")


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    worker: str
    queued_tokens: int  # sent, not yet answered
    tokens_per_s: float | None  # measured; None before the first completion
    matched_tokens: int = 0  # of this prompt, likely in the worker's prefix cache


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    worker: str
    num_running: int  # requests placed on it and not finished (local prefills included)
    max_num_seqs: int
    kv_used_tokens: int  # prompt + max_tokens of those requests
    kv_capacity_tokens: int
    local_prefill_tokens: int  # prompt tokens of local prefills not yet at their first token
    local_tokens_per_s: float | None
    slack_s: float  # stall its running requests absorb within their TPOT objectives
    # Time to a local prompt's first token as (seconds, seconds per token of the step's
    # prompts), measured; None: not yet (the rate above then stands in).
    local_ttft_fit: tuple[float, float] | None = None
    # Most tokens of one prompt's prefill per engine step while others run (0: no cap).
    chunk_tokens: int = 0

    def local_ttft_s(self, num_prompt_tokens: int, fitted_only: bool = False) -> float | None:
        """When a prompt sent here now gets its first token: once the engine has computed
        the prompt tokens `local_step_tokens` counts. Without a latency fit, the local
        prefill rate (an upper bound: it charges the step's fixed part to every token),
        unless ``fitted_only`` (admission: a bound must not refuse)."""
        tokens = local_step_tokens(self.local_prefill_tokens, num_prompt_tokens, self.chunk_tokens)
        if self.local_ttft_fit is not None:
            base, per_token = self.local_ttft_fit
            return base + per_token * tokens
        if fitted_only:
            return None
        return tokens / self.local_tokens_per_s if self.local_tokens_per_s else None

    def has_seat(self, kv_tokens: int) -> bool:
        return (self.num_running < self.max_num_seqs
                and self.kv_used_tokens + kv_tokens <= self.kv_capacity_tokens)

    @property
    def idle(self) -> bool:
        return self.num_running == 0


def local_step_tokens(pending_tokens: int, num_prompt_tokens: int, chunk_tokens: int) -> int:
    """The prompt tokens a decode engine computes before a prompt of ``num_prompt_tokens``
    sent to it now gets its first token: its own and the ``pending_tokens`` of the local
    prompts there not yet at their first tokens. With a chunk cap (``chunk_tokens``, vLLM's
    long_prefill_token_threshold) and a prompt within it, of the pending ones one chunk: it
    joins the next step beside the long prompt's next chunk, after what is left of the step
    running now. Measured (scripts/chunk_probe.py, a 67-token prompt sent 0.2 s after a
    1,900-token one, beside a decoding request): first token after 1.81 s with no cap,
    0.27 s with 256 (0.10 s alone), the long prompt's unchanged (1.93 s). Seen in the mixed
    benchmark without a cap: 6 interactive prompts arriving while an offline prompt of
    959-1,944 tokens moved to the decode worker had not reached its first token were
    refused on predicted first tokens of 0.89-2.07 s against a 0.51 s objective."""
    if 0 < chunk_tokens and num_prompt_tokens <= chunk_tokens:
        pending_tokens = min(pending_tokens, chunk_tokens)
    return pending_tokens + num_prompt_tokens


@dataclass(frozen=True, slots=True)
class Placement:
    where: Where
    worker: str
    predicted_ttft_s: float | None  # prefill finish, from now; None: not measured yet


def place(num_prompt_tokens: int, kv_tokens: int, prefill: list[PrefillLoad], decode: list[DecodeLoad],
          cfg: PlacementConfig, remote_open: bool = True, ttft_budget_s: float | None = None,
          rescue_rate: float | None = None, tier_starved: bool = False) -> Placement | None:
    """Where to prefill a prompt now; None: nowhere has room, wait.

    ``kv_tokens`` is what the request holds on a decode worker (prompt + max_tokens).
    ``remote_open`` False keeps the prefill tier for a ticket ahead that waits for it.
    ``ttft_budget_s``: time left to its TTFT objective. When the prefill tier would miss it
    and a decode worker would not, the decode worker takes the prompt: a short one even
    beyond its running requests' slack (a sure miss now is worse than a stall they may
    absorb), a longer one (up to ``cfg.rescue_prefill_max_tokens``) only within that slack
    and only when the tier is known to miss (full, or slower than the budget at its
    measured rate), since its stall is long; ``rescue_rate`` stands in for the prefill rate
    of a decode worker that has measured none (`rescue_long`).

    ``tier_starved``: the prefill tier shares its cores with decode engines that are busy
    now, and a tier with no rate measured beside them (None) is then taken to miss: on
    shared cores it runs at idle priority, and such a prompt was moved to a decode worker
    after `PlacementConfig.stall_unknown_s` anyway (13 and 14 of the 15 and 14 long prompts
    sent beside another request in the twenty-second session's two long A/B runs), its
    wait on the tier added to its first token and the tier's work on it thrown away.
    """
    remote = _best_remote(num_prompt_tokens, prefill, cfg) if remote_open else None
    local = _best_local(num_prompt_tokens, kv_tokens, decode, cfg)
    if local is None and ttft_budget_s is not None:
        rescue = None
        if num_prompt_tokens <= cfg.local_prefill_max_tokens:
            if remote is None or remote.predicted_ttft_s is None or remote.predicted_ttft_s > ttft_budget_s:
                rescue = _best_local(num_prompt_tokens, kv_tokens, decode, cfg, within_slack=False)
        elif (remote is None or (remote.predicted_ttft_s is None and tier_starved)
              or (remote.predicted_ttft_s is not None and remote.predicted_ttft_s > ttft_budget_s)):
            rescue = rescue_long(num_prompt_tokens, kv_tokens, decode, cfg, rescue_rate)
        if rescue is not None and rescue.predicted_ttft_s is not None and rescue.predicted_ttft_s <= ttft_budget_s:
            return rescue
    if local is None or remote is None:
        return local or remote
    if next(d for d in decode if d.worker == local.worker).idle:
        return local  # nothing to stall, and no handoff to wait for
    if local.predicted_ttft_s is None:
        return remote
    if remote.predicted_ttft_s is None:
        # The tier's rate is not known (no recent prefill there): a decode worker that
        # takes the prompt within its slack, at a known rate, is the sure start.
        return local
    return local if local.predicted_ttft_s <= remote.predicted_ttft_s else remote


def place_without_tier(num_prompt_tokens: int, kv_tokens: int, decode: list[DecodeLoad]) -> Placement | None:
    """With no prefill worker in rotation (all gone, down or draining), a decode worker
    prefills every prompt whatever its length, as one colocated engine would, rather than
    the gateway refusing all traffic: the one with a seat that runs the fewest requests;
    None: every one is full, wait."""
    worker = pick_decode(kv_tokens, decode)
    if worker is None:
        return None
    load = next(d for d in decode if d.worker == worker)
    return Placement(Where.LOCAL, worker, load.local_ttft_s(num_prompt_tokens))


def rescue_long(num_prompt_tokens: int, kv_tokens: int, decode: list[DecodeLoad],
                cfg: PlacementConfig, rescue_rate: float | None = None) -> Placement | None:
    """The decode worker that would prefill a prompt longer than the local limit (up to the
    rescue limit) soonest, idle or within its running requests' slack; None: none can.

    A decode worker that has prefilled nothing itself lately (no short prompts come, as in
    a workload of long ones only) has no rate to judge a rescue by; ``rescue_rate`` (the
    dispatcher passes the prefill tier's rate alone: the same model, with the cores to
    itself as the decode engine at normal priority has them) stands in for it."""
    if num_prompt_tokens <= cfg.local_prefill_max_tokens:
        return None
    if rescue_rate:
        decode = [d if d.local_tokens_per_s else replace(d, local_tokens_per_s=rescue_rate) for d in decode]
    return _best_local(num_prompt_tokens, kv_tokens, decode, cfg, max_tokens=cfg.rescue_prefill_max_tokens)


def stalled_after_s(num_prompt_tokens: int, predicted_ttft_s: float | None, cfg: PlacementConfig,
                    ttft_budget_s: float | None = None, local_ttft_s: float | None = None) -> float | None:
    """How long a remote prefill may go unanswered before it is moved to a decode worker;
    None: never (a prompt too long to prefill there). A prompt over the local limit moves
    only as a rescue (`move_stalled` with its TTFT budget, or within the running requests'
    slack once that budget is spent): seen in the long benchmark on an
    AVX2 machine, prompts sent to the tier at a rate measured with decode idle crawled beside
    the decodes that started after them, to first tokens at 20 and 26 s against 11 s.

    A prompt a decode worker may prefill as a matter of course (up to the local limit), sent
    with ``ttft_budget_s`` left to its objective and a decode worker's measured
    ``local_ttft_s`` for it, is moved no later than the last moment that still meets the
    objective (but not before ``stall_min_s``): seen in the mixed benchmark, a 236-token
    interactive prompt stalled on the tier beside a busy decode engine was moved after
    twice its predicted 0.3 s and reached its first token at 0.81 s against 0.49 s."""
    if num_prompt_tokens > max(cfg.local_prefill_max_tokens, cfg.rescue_prefill_max_tokens):
        return None
    after = cfg.stall_unknown_s if predicted_ttft_s is None else cfg.stall_factor * predicted_ttft_s
    if (num_prompt_tokens <= cfg.local_prefill_max_tokens and ttft_budget_s is not None
            and local_ttft_s is not None):
        after = min(after, ttft_budget_s - local_ttft_s)
    return max(after, cfg.stall_min_s)


def soonest_local_ttft_s(num_prompt_tokens: int, kv_tokens: int, decode: list[DecodeLoad]) -> float | None:
    """The soonest measured (fitted) first token a decode worker with a seat would give the
    prompt; None: none has a fit or a seat."""
    times = [t for d in decode if d.has_seat(kv_tokens)
             and (t := d.local_ttft_s(num_prompt_tokens, fitted_only=True)) is not None]
    return min(times, default=None)


def move_stalled(num_prompt_tokens: int, kv_tokens: int, decode: list[DecodeLoad], cfg: PlacementConfig,
                 ttft_budget_s: float | None = None, rescue_rate: float | None = None,
                 late_rescue: bool = True) -> Placement | None:
    """A decode worker to prefill a stalled remote prompt; None: none can take it now (by
    the same rules as a new placement, the prefill tier left out).

    A prompt already past its TTFT objective (``ttft_budget_s`` <= 0) has no budget a rescue
    could meet, yet waiting on helps no one: it holds the tier's queue budget, so longer
    prompts behind it wait in the gateway, and its caller waits on. It moves to a decode
    worker that takes it within its running requests' slack (`rescue_long`: their
    objectives are kept by the same rule as any rescue), unless ``late_rescue`` is False:
    the dispatcher keeps that slack for prompts that can still meet their objectives when
    any wait for it. Seen in the long benchmark: a
    663-token prompt starved on the tier beside a busy decode engine reached its first token
    after 17.4 s (objective 4.05 s); colocated vLLM prefills such a prompt in about 0.6 s.
    A prompt a decode worker may prefill as a matter of course (up to the local limit) past
    its objective moves to one with a seat whatever the slack and whoever waits: its stall
    is a short prompt's share of one step. Seen in the short benchmark (60 s per rate, at
    2.78 req/s right after a frozen turn): 42- and 32-token prompts sent to the tier while
    decode had no slack reached their first tokens after 13.2 and 13.4 s (objective 0.19 s)."""
    placement = place(num_prompt_tokens, kv_tokens, [], decode, cfg, remote_open=False, ttft_budget_s=ttft_budget_s,
                      rescue_rate=rescue_rate)
    if placement is not None or ttft_budget_s is None or ttft_budget_s > 0:
        return placement
    if num_prompt_tokens <= cfg.local_prefill_max_tokens:
        return _best_local(num_prompt_tokens, kv_tokens, decode, cfg, within_slack=False)
    return rescue_long(num_prompt_tokens, kv_tokens, decode, cfg, rescue_rate) if late_rescue else None


def _best_remote(num_prompt_tokens: int, prefill: list[PrefillLoad], cfg: PlacementConfig) -> Placement | None:
    best: tuple[tuple[float, int], Placement] | None = None
    for w in prefill:
        work = max(num_prompt_tokens - w.matched_tokens, 1)
        if w.queued_tokens and w.queued_tokens + work > cfg.prefill_queue_tokens:
            continue
        eta = (w.queued_tokens + work) / w.tokens_per_s if w.tokens_per_s else None
        key = (math.inf if eta is None else eta, w.queued_tokens + work)
        if best is None or key < best[0]:
            best = (key, Placement(Where.REMOTE, w.worker, eta))
    return best[1] if best else None


def _best_local(num_prompt_tokens: int, kv_tokens: int, decode: list[DecodeLoad],
                cfg: PlacementConfig, within_slack: bool = True, max_tokens: int | None = None) -> Placement | None:
    """The decode worker whose local prefill gives the soonest first token: with a seat,
    and idle or with running requests that absorb the stall (``within_slack``); None for a
    prompt over ``max_tokens`` (default: the local prefill limit)."""
    if num_prompt_tokens > (cfg.local_prefill_max_tokens if max_tokens is None else max_tokens):
        return None
    best: tuple[tuple[float, int], Placement] | None = None
    for d in decode:
        if not d.has_seat(kv_tokens):
            continue
        stall_s = num_prompt_tokens / d.local_tokens_per_s if d.local_tokens_per_s else None
        if not d.idle and (stall_s is None or (within_slack and stall_s > d.slack_s)):
            continue
        eta = d.local_ttft_s(num_prompt_tokens)
        key = (math.inf if eta is None else eta, d.num_running)
        if best is None or key < best[0]:
            best = (key, Placement(Where.LOCAL, d.worker, eta))
    return best[1] if best else None


def pick_decode(kv_tokens: int, decode: list[DecodeLoad]) -> str | None:
    """The decode worker for a prefilled request; None: every one is full, wait."""
    open_ = [d for d in decode if d.has_seat(kv_tokens)]
    if not open_:
        return None
    return min(open_, key=lambda d: (d.num_running, d.kv_used_tokens / max(d.kv_capacity_tokens, 1))).worker


@dataclass(frozen=True, slots=True)
class RunningRequest:
    """A request decoding on a worker, as the gateway sees it."""

    tpot_slo_s: float | None
    max_tokens: int
    num_generated: int
    first_token_s: float | None  # when its first token was sent; None: not yet
    priority: int = 0  # its class (gateway.queue.Priority): smaller is more urgent

    def margin_s(self, step_s: float, now_s: float, joining_steps: int = 0, joining_step_s: float = 0.0) -> float:
        """How long it can stall and still meet its TPOT objective, every later step taking
        ``step_s``, or ``joining_step_s`` for the first ``joining_steps`` of them (while a
        request that joins now runs beside it)."""
        assert self.tpot_slo_s is not None and self.first_token_s is not None
        remaining = max(self.max_tokens - self.num_generated, 0)
        beside = min(remaining, joining_steps)
        allowed_s = self.tpot_slo_s * max(self.max_tokens - 1, 1)
        return (allowed_s - (now_s - self.first_token_s)
                - (remaining - beside) * step_s - beside * joining_step_s)


def decode_slack_s(running: list[RunningRequest], step_s: float | None, now_s: float) -> float:
    """How long the worker's running requests can stall, all together, and still meet
    their TPOT objectives if every later step takes ``step_s``: the smallest such margin
    among those that can still meet them (inf: none to protect).

    One already past its margin misses whatever the worker does next, and is not
    protected (as in `join_slack_s`): seen in the long benchmark (thirty-fifth session,
    0.161 req/s), a request decoding at 84.5 ms per token against an 80.2 ms objective held
    the worker's slack at 0 for its last 7.5 s, and a 514-token prompt starved on the
    prefill tier all that time, to its first token at 8.4 s against 4.86 s."""
    slack = math.inf
    for r in running:
        if r.tpot_slo_s is None or r.first_token_s is None:
            continue
        margin = r.margin_s(step_s or 0.0, now_s)
        if margin >= 0:
            slack = min(slack, margin)
    return slack


def join_slack_s(running: list[RunningRequest], priority: int, max_tokens: int, step_s: float | None,
                 step_with_s: float | None, now_s: float) -> float:
    """What a request of ``priority`` and ``max_tokens`` joining a decode worker now leaves
    of the slack of the running requests of a higher priority (a smaller value) that meet
    their TPOT objectives now (steps of ``step_s``), with it beside them (steps of
    ``step_with_s`` while it runs): the smallest such margin; below 0, its joining alone
    makes one miss; inf: none to protect, or no step measured.

    A lower class must not cost a higher one its objective: seen in a mixed run at 0.266
    req/s (scripts/beside_table.py), 4 of the 11 interactive requests late on TPOT against a
    39.2 ms objective had an offline request decoding beside them. One already missing is
    not protected: the join does not decide it."""
    if step_s is None or step_with_s is None:
        return math.inf
    slack = math.inf
    for r in running:
        if r.priority >= priority or r.tpot_slo_s is None or r.first_token_s is None:
            continue
        if r.margin_s(step_s, now_s) < 0:
            continue
        slack = min(slack, r.margin_s(step_s, now_s, max(max_tokens - 1, 0), step_with_s))
    return slack


class PrefixIndex:
    """Which prefill worker most recently prefilled each chain of leading blocks.

    Keys chain block hashes as vLLM's prefix cache does (a block's key covers every token
    before it), so a match of k keys means the first k full blocks are the same. Bounded:
    least recently used chains are forgotten first.
    """

    def __init__(self, block_size: int, max_entries: int = 65536, max_blocks: int = 64) -> None:
        assert block_size > 0 and max_entries > 0
        self.block_size = block_size
        self._max_entries = max_entries
        self._max_blocks = max_blocks
        self._owner: OrderedDict[int, str] = OrderedDict()

    def keys(self, token_ids: tuple[int, ...]) -> list[int]:
        """The chained keys of a prompt's leading full blocks (computed once per request)."""
        keys, h = [], 0
        num_blocks = min(len(token_ids) // self.block_size, self._max_blocks)
        for i in range(num_blocks):
            h = hash((h, token_ids[i * self.block_size:(i + 1) * self.block_size]))
            keys.append(h)
        return keys

    def matched_tokens(self, keys: list[int]) -> dict[str, int]:
        """Per worker, how many leading tokens of the prompt with these keys it prefilled last."""
        out: dict[str, int] = {}
        for i, key in enumerate(keys):
            owner = self._owner.get(key)
            if owner is None:
                break
            out[owner] = (i + 1) * self.block_size
        return out

    def record(self, keys: list[int], worker: str) -> None:
        for key in keys:
            self._owner[key] = worker
            self._owner.move_to_end(key)
        while len(self._owner) > self._max_entries:
            self._owner.popitem(last=False)

    def forget(self, worker: str) -> None:
        for key in [k for k, w in self._owner.items() if w == worker]:
            del self._owner[key]
