"""One Config per process, built in one place (the CLI) and validated on construction."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")
KV_TRANSPORTS = ("shm", "tcp", "nccl", "cuda_ipc")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
ENGINE_EXECUTORS = ("uni", "mp")
# On SIGTERM, SIGINT or a drain request, the default for how long a server lets the requests
# in flight finish (--drain-grace-s): a 128-token answer at 64 ms per token (an AVX2-only
# VM's unloaded TPOT) takes 8 s, and the gateway's fixed 10 s once cut a test's answer.
DRAIN_GRACE_S = 30.0
# `pdserve up` kills a child (its whole process group) this long after its drain grace, if
# it still runs then: time to stop its engine once its requests are done.
STOP_GRACE_S = 15.0


# A decode worker prefills a long prompt (a rescue) in chunks of at least this many tokens
# per engine step while other requests run (vLLM's long_prefill_token_threshold, adaptive:
# with n requests on the engine a chunk is max(cap, step / n)), so that a short prompt
# arriving meanwhile (up to the gateway's --local-prefill-max-tokens, 256) starts in the
# next step instead of after the long ones.
DECODE_LONG_PREFILL_TOKENS = 128
# ... and computes at most this many tokens in any one engine step. vLLM lifts the chunk cap
# while a prompt is the engine's only request ("nobody to starve"), so without a budget a
# long prompt sent to an idle decode worker is prefilled in one step, and a short prompt
# arriving a moment later waits for all of it: seen in the mixed benchmark, interactive
# prompts of 165-246 tokens sent to a decode worker just after a 1,944- or 1,966-token
# offline prompt reached their first tokens 2.6-3.0 s later, 0.2-0.7 s after the long
# one's. With a fixed cap of 256 and this step, two long prompts' chunks filled every step
# and a short prompt waited for both (scripts/chunk_probe.py with LONGS=2: 6.99 s behind two
# 1,900-token prompts; 0.72 s with the adaptive cap of 128, docs/benchmarks.md).
DECODE_STEP_TOKENS = 512


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    # Cores the engine's compute threads are bound to (VLLM_CPU_OMP_THREADS_BIND), e.g. "0" or "0-3".
    cpus: str | None = None
    # "idle": the engine yields its cores to any other work (pdserve.sched); "normal".
    sched: str = "normal"
    # GPU engines: the fraction of the GPU's memory this engine may take (None: vLLM's 0.9).
    gpu_memory_utilization: float | None = None
    # KV cache size in GiB on a CPU engine (VLLM_CPU_KVCACHE_SPACE).
    kv_cache_gib: int = 2
    # Where a CPU engine computes: "uni", in its engine-core process; "mp", in a model-worker
    # process of its own (vLLM's choice on CPUs). pdserve.engine.build_engine says why uni.
    executor: str = "uni"
    # Tokens per KV block. CPU attention needs a multiple of 32.
    block_size: int = 32
    max_model_len: int | None = None
    max_num_seqs: int = 64
    # Most tokens an engine step computes (vLLM's max_num_batched_tokens); None: twice the
    # chunk cap on a decode worker that has one (DECODE_STEP_TOKENS by default), vLLM's own
    # default otherwise.
    max_num_batched_tokens: int | None = None
    # Most tokens of one prompt's prefill in an engine step while other requests run (vLLM's
    # long_prefill_token_threshold; 0: none); None: DECODE_LONG_PREFILL_TOKENS on a decode
    # worker, none on a prefill worker.
    long_prefill_tokens: int | None = None
    # The chunk cap as a floor: with n requests on the engine a long prompt's chunk is
    # max(cap, step / n) (vLLM's long_prefill_token_threshold_adaptive), so a short prompt
    # finds room in a step beside two long prompts' chunks.
    # None: on where the cap is DECODE_LONG_PREFILL_TOKENS by default (a decode worker).
    long_prefill_adaptive: bool | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    # Compute (and KV) dtype; "auto": the model's on hardware with native bf16/fp16 math,
    # float32 on CPUs without it (pdserve.engine.resolve_dtype).
    dtype: str = "auto"
    # KV transports this worker serves (prefill) or reads (decode), in order of preference.
    kv_transports: tuple[str, ...] = ("shm", "tcp", "nccl")
    # Prefill side: ports of the tcp and nccl transports' control servers (0: a free one,
    # picked at start-up), and the address decode workers reach them at (default: host).
    kv_tcp_port: int = 0
    kv_nccl_port: int = 0
    kv_host: str | None = None
    # Every KV socket operation and wait (connect, fetch, pair) gives up after this.
    kv_timeout_s: float = 10.0
    # How long a prefill worker keeps a prompt's KV for a decode worker that has not taken it.
    kv_lease_s: float = 30.0
    # Decode side: what a failed KV load does: fail the request, or recompute the prompt.
    kv_load_failure_policy: str = "recompute"
    metrics_port: int | None = None
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    json_logs: bool = False
    # The gateway to register with (host:port); None: only reachable by address.
    gateway: str | None = None
    # Host the gateway reaches this worker at (default: --host, or this machine's name when
    # --host is a wildcard).
    advertise_host: str | None = None
    # On SIGTERM or a drain request: how long in-flight requests may take to finish.
    drain_grace_s: float = DRAIN_GRACE_S

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.executor not in ENGINE_EXECUTORS:
            raise ValueError(f"--executor must be one of {ENGINE_EXECUTORS}, got {self.executor!r}")
        if self.sched not in ("normal", "idle"):
            raise ValueError(f"--sched must be normal or idle, got {self.sched!r}")
        if self.block_size <= 0 or self.block_size % 16:
            raise ValueError(f"--block-size must be a positive multiple of 16 (32 on CPU), got {self.block_size}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"--kv-cache-gib must be positive, got {self.kv_cache_gib}")
        unknown = set(self.kv_transports) - set(KV_TRANSPORTS)
        if not self.kv_transports or unknown:
            raise ValueError(
                f"--kv-transport takes a comma-separated list of {', '.join(KV_TRANSPORTS)}; "
                f"got {','.join(self.kv_transports) or 'nothing'}"
            )
        if self.kv_timeout_s <= 0:
            raise ValueError(f"--kv-timeout-s must be positive, got {self.kv_timeout_s}")
        if self.kv_lease_s <= 0:
            raise ValueError(f"--kv-lease-s must be positive, got {self.kv_lease_s}")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"--kv-load-failure-policy must be one of {LOAD_FAILURE_POLICIES}, "
                f"got {self.kv_load_failure_policy!r}"
            )
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port out of range: {self.port}")
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace-s must be >= 0, got {self.drain_grace_s}")
        if "-" in self.worker_id or "/" in self.worker_id:
            raise ValueError(f"worker id may not contain '-' or '/': {self.worker_id!r}")
        if self.long_prefill_tokens is not None and self.long_prefill_tokens < 0:
            raise ValueError(f"--long-prefill-tokens must be >= 0, got {self.long_prefill_tokens}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < max(self.long_prefill_threshold, 1):
            raise ValueError(f"--max-num-batched-tokens must be >= 1 and at least --long-prefill-tokens "
                             f"({self.long_prefill_threshold}), got {self.max_num_batched_tokens}")

    @property
    def long_prefill_threshold(self) -> int:
        """vLLM's long_prefill_token_threshold for this worker's engine (0: no cap)."""
        if self.long_prefill_tokens is not None:
            return self.long_prefill_tokens
        return DECODE_LONG_PREFILL_TOKENS if self.role == "decode" else 0

    @property
    def adaptive_chunks(self) -> bool:
        """vLLM's long_prefill_token_threshold_adaptive for this worker's engine."""
        if self.long_prefill_adaptive is not None:
            return self.long_prefill_adaptive and self.long_prefill_threshold > 0
        return self.role == "decode" and self.long_prefill_tokens is None

    @property
    def step_tokens(self) -> int | None:
        """vLLM's max_num_batched_tokens for this worker's engine (None: vLLM's default): on
        a decode worker with a chunk cap, unless set, DECODE_STEP_TOKENS with the default cap
        and twice a cap given, and no fewer than its max_num_seqs."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        cap = self.long_prefill_threshold
        if self.role != "decode" or cap <= 0:
            return None
        step = DECODE_STEP_TOKENS if self.long_prefill_tokens is None else 2 * cap
        # vLLM wants a step to have room for a token of each of its max_num_seqs requests.
        return max(step, self.max_num_seqs)


CLASSES = ("interactive", "batch", "offline")
GATEWAY_POLICIES = ("slo", "fifo")


def per_class(text: str, name: str, cast=float) -> tuple:
    """``a,b,c`` (interactive, batch, offline) -> a 3-tuple; one value applies to all."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or not all(parts):
        raise ValueError(f"{name} takes one value or three (interactive,batch,offline); got {text!r}")
    try:
        return tuple(cast(p) for p in parts)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from e


@dataclass(frozen=True)
class GatewayConfig:
    model: str
    # Workers given by address; more join through the registry (`--gateway` on a worker).
    prefill_addrs: tuple[str, ...] = ()
    decode_addrs: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 50051
    tokenizer_workers: int = 1
    metrics_port: int | None = None
    # How often worker health and load are polled.
    poll_interval_s: float = 1.0
    # Requests in flight at once (queued or running) before RESOURCE_EXHAUSTED.
    max_inflight: int = 256
    # KV transport between a prefill and a decode worker: "auto" picks by where they run
    # (same host: shm on CPU, cuda_ipc on GPU; else nccl on GPU, tcp on CPU).
    kv_transport: str = "auto"
    json_logs: bool = False
    # Serving policy: "slo" (classes by weight, EDF, admission by predicted latency) or
    # "fifo" (arrival order, no admission beyond the queue bounds).
    policy: str = "slo"
    # Per class (interactive, batch, offline): default objectives in ms (0: none; a request
    # without objectives, its own or its class's, is never refused by prediction), weights
    # of the share of prefill work, queue bounds.
    slo_ttft_ms: tuple[int, int, int] = (0, 0, 0)
    slo_tpot_ms: tuple[int, int, int] = (0, 0, 0)
    class_weights: tuple[float, float, float] = (8.0, 2.0, 1.0)
    queue_limits: tuple[int, int, int] = (256, 512, 1024)
    # A queued request older than this is served next, whatever its class.
    aging_s: float = 30.0
    # Prompt tokens a prefill worker is sent beyond the one it runs.
    prefill_queue_tokens: int = 1024
    # Longest prompt a decode worker may prefill itself (0: never).
    local_prefill_max_tokens: int = 256
    # Longest prompt a decode worker may prefill itself when the prefill tier would miss its
    # TTFT objective and the running requests absorb the stall (0: none beyond the above).
    rescue_prefill_max_tokens: int = 4096
    # Slo policy: the longest a request waits for a decode worker where its joining would make
    # a higher class's running requests miss their TPOT objectives (0: never).
    priority_hold_s: float = 5.0
    # Per class: tokens a decode worker gathers into one streamed message (the first and
    # last go at once). Fewer messages cost the gateway less CPU; interactive streams get 1.
    stream_intervals: tuple[int, int, int] = (1, 4, 8)
    # "shared": one DecodeStream call per decode worker for all requests (a message per
    # engine step); "per-request": a Decode call each (a message per request per step).
    decode_stream: str = "shared"
    # Registered workers heartbeat this often and leave rotation after this much silence.
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    # Attempts at a request whose worker fails before its first token was streamed.
    max_attempts: int = 3
    # On SIGTERM or SIGINT: how long the calls in flight (queued ones too) may take to finish;
    # those still streaming then end with UNAVAILABLE.
    drain_grace_s: float = DRAIN_GRACE_S

    def __post_init__(self) -> None:
        if self.policy not in GATEWAY_POLICIES:
            raise ValueError(f"--policy must be one of {GATEWAY_POLICIES}, got {self.policy!r}")
        for name, values in (("--slo-ttft-ms", self.slo_ttft_ms), ("--slo-tpot-ms", self.slo_tpot_ms),
                             ("--queue-limits", self.queue_limits)):
            if len(values) != 3 or any(v < 0 for v in values):
                raise ValueError(f"{name} needs three values >= 0, got {values}")
        if len(self.class_weights) != 3 or any(w <= 0 for w in self.class_weights):
            raise ValueError(f"--class-weights needs three values > 0, got {self.class_weights}")
        if self.decode_stream not in ("shared", "per-request"):
            raise ValueError(f"--decode-stream is shared or per-request, got {self.decode_stream!r}")
        if len(self.stream_intervals) != 3 or any(n < 1 for n in self.stream_intervals):
            raise ValueError(f"--stream-intervals needs three values >= 1, got {self.stream_intervals}")
        if any(n < 1 for n in self.queue_limits):
            raise ValueError(f"--queue-limits must be >= 1 per class, got {self.queue_limits}")
        if self.aging_s <= 0:
            raise ValueError(f"--aging-s must be > 0, got {self.aging_s}")
        if self.prefill_queue_tokens < 1:
            raise ValueError(f"--prefill-queue-tokens must be >= 1, got {self.prefill_queue_tokens}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.rescue_prefill_max_tokens < 0:
            raise ValueError(f"--rescue-prefill-max-tokens must be >= 0, got {self.rescue_prefill_max_tokens}")
        if self.priority_hold_s < 0:
            raise ValueError(f"--priority-hold-s must be >= 0, got {self.priority_hold_s}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError(
                f"need 0 < --heartbeat-interval-s < --heartbeat-timeout-s, got "
                f"{self.heartbeat_interval_s} and {self.heartbeat_timeout_s}")
        if self.max_attempts < 1:
            raise ValueError(f"--max-attempts must be >= 1, got {self.max_attempts}")
        if self.drain_grace_s < 0:
            raise ValueError(f"--drain-grace-s must be >= 0, got {self.drain_grace_s}")
        if self.tokenizer_workers < 1:
            raise ValueError(f"--tokenizer-workers must be >= 1, got {self.tokenizer_workers}")
        if self.max_inflight < 1:
            raise ValueError(f"--max-inflight must be >= 1, got {self.max_inflight}")
