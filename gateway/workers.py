"""The gateway's view of the worker tiers: who is up, what they serve, how loaded they are.

Workers come from two places: addresses given at start (``--prefill``/``--decode``,
"static") and the registry (gateway/registry.py: workers that register and heartbeat).
Every worker is polled (gRPC health; Info for a static one, again after it comes back,
since a restarted worker is a new engine) every poll interval; a registered worker also
leaves rotation when it misses heartbeats. A worker is routable when healthy, not
draining, and compatible with the first known worker (same KV layout, a common transport,
same model limits); a worker that cannot be is refused at registration.

Load is what this gateway sent and has not seen finish: a prefill worker's unanswered
prompt tokens and its measured prefill rate; a decode worker's seats (requests it runs,
with their KV reservation and progress), the prompt tokens it prefills itself, and its
measured time per token. Placement (gateway/placement.py) reads it as value objects.
"""

from __future__ import annotations

import asyncio
import time
import logging
from dataclasses import dataclass, field, replace

import grpc
from grpc_health.v1 import health_pb2_grpc

from gateway.admission import best_case_quantile
from gateway.meters import JoinMeter, LatencyMeter, RatioMeter, ServiceMeter, StepMeter
from gateway.decode_stream import DecodeStreams
from gateway.placement import DecodeLoad, PrefillLoad, RunningRequest, decode_slack_s, join_slack_s
from pdserve import rpc
from protos import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Seat:
    """A request running on a decode worker, from placement until its stream ends."""

    request_id: str
    kv_tokens: int  # prompt + max_tokens: the most KV it can hold
    max_tokens: int
    tpot_slo_s: float | None
    num_generated: int = 0
    first_token_s: float | None = None
    local_prefill_tokens: int = 0  # prompt tokens it prefills here, until its first token
    local_start_s: float = 0.0  # when its local prefill was placed
    local_step_tokens: int = 0  # its prompt and the local prompts pending with it then
    predicted_step_s: float | None = None  # the step estimate when it joined (unscaled)
    forecast_tpot_s: float | None = None  # what admission forecast then (scaled)
    priority: int = 0  # its class (gateway.queue.Priority)

    def view(self) -> RunningRequest:
        return RunningRequest(self.tpot_slo_s, self.max_tokens, self.num_generated, self.first_token_s,
                              self.priority)


# A healthy worker leaves rotation after this many health checks in a row went unanswered
# (each waits 2 s); a refused connection or NOT_SERVING takes it out at once. A prefill
# engine at idle CPU priority under full decode load answers late, not never: seen in the
# long benchmark, four times "prefill worker ... is down" and back within 1-4 s, the
# gateway NOT_SERVING for each of those moments with no worker gone.
HEALTH_CHECKS_UNANSWERED_DOWN = 3

STUBS = {"prefill": worker_pb2_grpc.PrefillWorkerStub, "decode": worker_pb2_grpc.DecodeWorkerStub}


@dataclass(eq=False)
class Worker:
    role: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub
    info: worker_pb2.WorkerInfo | None = None
    healthy: bool = False
    incompatible: str | None = None
    # "static" (an address given at start) or "registered" (the registry).
    source: str = "static"
    draining: bool = False
    # Registered workers: their last heartbeat (time.monotonic()) and load, and whether
    # `pdserve drain` asked them to leave (told in the next heartbeat reply).
    last_heartbeat_s: float | None = None
    reported_load: worker_pb2.WorkerLoad | None = None
    # Made with the channel: a stub made once it is closed blocks (rpc.health_status).
    health: health_pb2_grpc.HealthStub | None = None
    # Decode: its DecodeStream call, shared by the requests sent to it (opened on first use).
    decode_streams: DecodeStreams | None = None
    metrics_url: str = ""
    drain_requested: bool = False
    # Prefill: prompts and their tokens sent and unanswered, and the rate it prefills them.
    num_prefills: int = 0
    queued_tokens: int = 0
    prefill_meter: ServiceMeter = field(default_factory=ServiceMeter)
    # Decode: its seats, and the rates of its own prefills and of its steps.
    seats: set[Seat] = field(default_factory=set)
    local_meter: ServiceMeter = field(default_factory=ServiceMeter)
    local_latency: LatencyMeter = field(default_factory=LatencyMeter)
    tpot_ratio: RatioMeter = field(default_factory=RatioMeter)
    step_meter: StepMeter = field(default_factory=StepMeter)
    join_meter: JoinMeter = field(default_factory=JoinMeter)
    last_local_prefill_s: float = float("-inf")  # when its latest local prefill finished
    unanswered_health_checks: int = 0  # in a row, while healthy

    @property
    def routable(self) -> bool:
        return self.healthy and self.info is not None and self.incompatible is None and not self.draining

    @property
    def worker_id(self) -> str:
        return self.info.worker_id if self.info is not None else ""

    @property
    def state(self) -> str:
        if self.info is None:
            return "starting" if self.healthy else "down"
        if self.incompatible:
            return "incompatible"
        if not self.healthy:
            return "down"
        return "draining" if self.draining else "ready"

    @property
    def num_inflight(self) -> int:
        return len(self.seats) if self.role == "decode" else self.num_prefills

    def prefill_load(self, now_s: float, matched_tokens: int = 0, contended: bool | None = None,
                     fallback_rate: float | None = None) -> PrefillLoad:
        # The rate measured under the decode load there is now (``contended``). Beside
        # running decodes, only a rate measured so: a worker a prompt was just taken back
        # from, or one that has prefilled nothing beside decode lately, promises no start
        # time, and a prompt sent to it is moved after `PlacementConfig.stall_unknown_s`
        # (placement prefers a decode worker with a known rate). Its rate alone would
        # promise one it does not get: seen in the long benchmark, prompts sent beside a
        # decoding request on such a promise (1.7-4.9 s) waited twice that before moving,
        # to first tokens of 5.3-12.3 s where a move after 1 s gave 2.7-5.4 s.
        # With decode idle (``contended`` False) the worker has the cores to itself,
        # whatever kept it off them before: when nothing recent says, its rate alone
        # however old, else ``fallback_rate`` (a decode engine's own prefill rate: the same
        # model on the same cores); see ServiceMeter.alone_tokens_per_s.
        meter = self.prefill_meter
        rate = None if meter.stalled(now_s) else meter.tokens_per_s(now_s, self.queued_tokens, contended,
                                                                    exact=contended is True)
        if rate is None and contended is False:
            rate = meter.alone_tokens_per_s(now_s, self.queued_tokens, fallback_rate)
        return PrefillLoad(self.address, self.queued_tokens, rate, matched_tokens)

    def predict_tpot_s(self, num_running: int, now_s: float) -> float | None:
        """Time per token with this many requests running: the step estimate, scaled by how
        far recent requests' own TPOT ran from it."""
        step = self.step_meter.predict(num_running, now_s)
        return None if step is None else step * self.tpot_ratio.ratio(now_s)

    def join_step_s(self, max_tokens: int, now_s: float) -> float | None:
        """The step estimate over the life of a request of ``max_tokens`` joining now, as
        the running requests finish and others join at the recent rate (unscaled: what
        `tpot_ratio` measures against)."""
        remaining = [max(s.max_tokens - s.num_generated, 0) for s in self.seats]
        step_now = self.step_meter.predict(len(self.seats) + 1, now_s)
        return self.step_meter.predict_life(remaining, max_tokens - 1, now_s,
                                            self.join_meter.arrivals(step_now, now_s))

    def predict_join_tpot_s(self, max_tokens: int, now_s: float) -> tuple[float, float] | None:
        """The TPOT a request of ``max_tokens`` joining now should see (`join_step_s` scaled
        by the median of how far recent requests' own TPOT ran from their estimates), and
        at best (scaled by a low quantile of those ratios instead, higher while recent
        requests miss their objectives: `admission.best_case_quantile`)."""
        step = self.join_step_s(max_tokens, now_s)
        if step is None:
            return None
        q = best_case_quantile(self.tpot_ratio.miss_share(now_s))
        return (step * self.tpot_ratio.ratio(now_s), step * self.tpot_ratio.quantile(q, now_s))

    def join_slack_s(self, priority: int, max_tokens: int, now_s: float) -> float:
        """What a request of ``priority`` joining now leaves of the slack of the running
        requests of a higher priority (`placement.join_slack_s`)."""
        n = len(self.seats)
        return join_slack_s([s.view() for s in self.seats], priority, max_tokens,
                            self.predict_tpot_s(n, now_s), self.predict_tpot_s(n + 1, now_s), now_s)

    def decode_load(self, now_s: float) -> DecodeLoad:
        assert self.info is not None
        local_tokens = sum(s.local_prefill_tokens for s in self.seats)
        local_tps = self.local_meter.tokens_per_s(now_s, local_tokens)
        slack = decode_slack_s([s.view() for s in self.seats], self.predict_tpot_s(len(self.seats), now_s), now_s)
        if local_tps and local_tokens:
            slack = max(0.0, slack - local_tokens / local_tps)  # stalls already on their way
        return DecodeLoad(
            worker=self.address,
            num_running=len(self.seats),
            max_num_seqs=self.info.max_num_seqs or 64,
            kv_used_tokens=sum(s.kv_tokens for s in self.seats),
            kv_capacity_tokens=self.info.kv_capacity_tokens or (1 << 31),
            local_prefill_tokens=local_tokens,
            local_tokens_per_s=local_tps,
            slack_s=slack,
            local_ttft_fit=self.local_latency.fit(now_s),
            chunk_tokens=self.info.long_prefill_tokens,
        )


@dataclass
class WorkerPool:
    workers: list[Worker] = field(default_factory=list)

    @classmethod
    def connect(cls, prefill_addrs: tuple[str, ...], decode_addrs: tuple[str, ...]) -> WorkerPool:
        pool = cls()
        for role, addrs in (("prefill", prefill_addrs), ("decode", decode_addrs)):
            for address in addrs:
                pool.workers.append(_open(role, address))
        return pool

    # ------------------------------------------------------------ registry --------------

    def register(self, info: worker_pb2.WorkerInfo, address: str, metrics_url: str, now_s: float) -> Worker:
        """Adds (or refreshes) a registered worker; raises ValueError, saying why, when it
        cannot work with the workers already known. A new engine at a known address (a
        restarted worker) replaces the old entry."""
        if info.role not in STUBS:
            raise ValueError(f"role must be prefill or decode, got {info.role!r}")
        others = [w for w in self.workers if w.info is not None and w.address != address
                  and w.worker_id != info.worker_id and w.incompatible is None]
        if others:
            problem = _incompatibility(others[0].info, info)
            if problem:
                raise ValueError(f"{info.role} worker {info.worker_id} at {address} cannot join: {problem}")
        old = next((w for w in self.workers if w.address == address or w.worker_id == info.worker_id), None)
        if old is not None and (old.address != address or old.role != info.role or old.worker_id != info.worker_id):
            # Another engine (a restarted worker): a fresh channel, since the old one may sit
            # in reconnect backoff after the process it talked to died.
            self.workers.remove(old)
            asyncio.ensure_future(old.channel.close())
            old = None
        worker = old or _open(info.role, address)
        if old is None:
            self.workers.append(worker)
        if worker.worker_id != info.worker_id:
            logger.info("%s worker %s registered at %s", info.role, info.worker_id, address)
        worker.info, worker.source, worker.metrics_url = info, "registered", metrics_url
        worker.healthy, worker.draining, worker.drain_requested = True, False, False
        worker.last_heartbeat_s = now_s
        return worker

    def by_id(self, worker_id: str) -> Worker:
        """Raises KeyError for an unknown id."""
        found = next((w for w in self.workers if w.worker_id == worker_id), None)
        if found is None:
            raise KeyError(worker_id)
        return found

    def heartbeat(self, worker_id: str, load: worker_pb2.WorkerLoad, draining: bool, now_s: float) -> bool:
        """Records a heartbeat; returns whether the worker is asked to drain."""
        worker = self.by_id(worker_id)
        if not worker.healthy:
            logger.info("%s worker %s is back", worker.role, worker_id)
        if draining and not worker.draining:
            logger.info("%s worker %s is draining", worker.role, worker_id)
        worker.last_heartbeat_s, worker.reported_load, worker.healthy = now_s, load, True
        worker.draining = worker.draining or draining
        return worker.drain_requested

    def deregister(self, worker_id: str) -> Worker | None:
        worker = next((w for w in self.workers if w.worker_id == worker_id), None)
        if worker is not None:
            self.workers.remove(worker)
            asyncio.ensure_future(worker.channel.close())
            logger.info("%s worker %s left", worker.role, worker_id)
        return worker

    def drain(self, worker_id: str) -> Worker:
        worker = self.by_id(worker_id)
        worker.draining = worker.drain_requested = True
        logger.info("%s worker %s: drain requested", worker.role, worker_id)
        return worker

    def expire_heartbeats(self, now_s: float, timeout_s: float) -> list[Worker]:
        """Registered workers silent for ``timeout_s`` leave rotation; after 10x that they
        are forgotten (a worker that comes back registers again)."""
        lost = []
        for worker in list(self.workers):
            if worker.source != "registered" or worker.last_heartbeat_s is None:
                continue
            silent_s = now_s - worker.last_heartbeat_s
            if silent_s > timeout_s and worker.healthy:
                logger.warning("%s worker %s missed heartbeats for %.1f s: out of rotation",
                               worker.role, worker.worker_id, silent_s)
                worker.healthy = False
                lost.append(worker)
            if silent_s > 10 * timeout_s:
                self.deregister(worker.worker_id)
        return lost

    def excuse_pause(self, paused_s: float, now_s: float) -> int:
        """This gateway did not run for ``paused_s`` up to ``now_s`` (stopped, starved,
        a VM paused): heartbeats that came meanwhile were not read, so that time is not
        counted as the registered workers' silence. Returns how many workers it excused
        (static workers have no heartbeats: none with only those)."""
        excused = 0
        for worker in self.workers:
            if worker.source == "registered" and worker.last_heartbeat_s is not None:
                worker.last_heartbeat_s = min(now_s, worker.last_heartbeat_s + paused_s)
                excused += 1
        return excused

    def tier(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def routable(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.routable]

    def decode_loads(self, now_s: float, joining: tuple[int, int] | None = None) -> list[DecodeLoad]:
        """The routable decode workers' loads; for a request ``joining`` (its priority and
        max_tokens) that a higher class's objectives hold back: without the workers where its
        joining would make a running request of a higher class miss its TPOT objective, and
        on the others with such requests' slack (what they keep with it beside them) bounding
        the stall of its prefill there (`placement.join_slack_s`)."""
        loads = []
        for w in self.routable("decode"):
            load = w.decode_load(now_s)
            if joining is not None:
                keep = w.join_slack_s(*joining, now_s)
                if keep < 0:
                    continue
                if keep < load.slack_s:
                    load = replace(load, slack_s=keep)
            loads.append(load)
        return loads

    def by_address(self, address: str) -> Worker:
        return next(w for w in self.workers if w.address == address)

    def ready(self) -> bool:
        """Serving needs a decode worker; without a prefill worker in rotation the decode
        workers prefill every prompt themselves (placement.place_without_tier)."""
        return bool(self.routable("decode"))

    def pick(self, role: str) -> Worker | None:
        return min(self.routable(role), key=lambda w: w.num_inflight, default=None)

    def kv_transport(self, prefill: Worker, preference: str = "auto") -> str:
        """The transport ``prefill`` publishes a prompt's KV through: one every routable
        decode worker reads, so whichever decode worker is picked next can load it.

        ``auto`` follows where the workers run (kvtransfer.transport.choose_transport):
        one host: shared memory on CPU, CUDA IPC on GPU; across hosts: NCCL on GPU, TCP on
        CPU; failing that, the prefill worker's first common transport.
        """
        assert prefill.info is not None
        readers = [w.info for w in self.tier("decode") if w.routable]
        common = [t for t in prefill.info.transports if all(t in r.transports for r in readers)]
        if preference != "auto":
            if preference not in common:
                raise LookupError(
                    f"KV transport {preference!r} is not served by prefill worker "
                    f"{prefill.address} and read by every decode worker (common: {common})"
                )
            return preference
        if not common:
            raise LookupError(f"prefill worker {prefill.address} shares no KV transport with the decode tier")
        same_host = all(r.host_id == prefill.info.host_id for r in readers)
        gpu = prefill.info.kv_device == "cuda"
        wanted = ("cuda_ipc" if gpu else "shm") if same_host else ("nccl" if gpu else "tcp")
        return wanted if wanted in common else common[0]

    def model_info(self) -> worker_pb2.WorkerInfo | None:
        """Limits the gateway validates against: those of a routable decode worker."""
        worker = self.pick("decode")
        return worker.info if worker else None

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(w) for w in self.workers))
        self._check_compatibility()

    async def _poll(self, worker: Worker) -> None:
        status = await rpc.health_status(worker.health)
        if status is rpc.Health.NO_ANSWER and worker.healthy:
            worker.unanswered_health_checks += 1
            if worker.unanswered_health_checks < HEALTH_CHECKS_UNANSWERED_DOWN:
                return  # slow, not gone: it stays in rotation
            logger.info("%s worker %s did not answer %d health checks in a row",
                        worker.role, worker.address, worker.unanswered_health_checks)
        else:
            worker.unanswered_health_checks = 0
        healthy = status is rpc.Health.SERVING
        if worker.source == "registered":
            # A failed health check says it is gone now; an answered one is as good as a
            # heartbeat (a busy host may delay heartbeats, not a live worker's answers).
            if not healthy and worker.healthy:
                logger.info("%s worker %s at %s is down", worker.role, worker.worker_id, worker.address)
                worker.healthy = False
            elif healthy and worker.last_heartbeat_s is not None:
                worker.last_heartbeat_s = max(worker.last_heartbeat_s, time.monotonic())
            return
        if healthy and not worker.healthy:
            worker.info = None  # a restarted worker is a new engine: ask again
        if healthy and worker.info is None:
            try:
                worker.info = await worker.stub.Info(worker_pb2.InfoRequest(), timeout=5)
            except grpc.aio.AioRpcError as e:
                logger.warning("%s worker %s: Info failed: %s", worker.role, worker.address, e.details())
                healthy = False
        if healthy != worker.healthy:
            logger.info("%s worker %s is %s", worker.role, worker.address, "up" if healthy else "down")
        worker.healthy = healthy

    def mark_down(self, worker: Worker, why: str) -> None:
        """A call found the worker gone: out of rotation until health or a heartbeat says otherwise."""
        if worker.healthy:
            logger.warning("%s worker %s is down: %s", worker.role, worker.address, why)
        worker.healthy = False

    def _check_compatibility(self) -> None:
        known = [w for w in self.workers if w.info is not None]
        if not known:
            return
        reference = known[0].info
        for worker in known[1:]:
            problem = _incompatibility(reference, worker.info)
            if problem != worker.incompatible and problem:
                logger.error("%s worker %s cannot be used: %s", worker.role, worker.address, problem)
            worker.incompatible = problem

    async def close(self) -> None:
        await asyncio.gather(*(w.channel.close() for w in self.workers))


def _open(role: str, address: str) -> Worker:
    channel = grpc.aio.insecure_channel(address, options=rpc.CHANNEL_OPTIONS)
    return Worker(role, address, channel, STUBS[role](channel), health=health_pb2_grpc.HealthStub(channel))


def _incompatibility(a: worker_pb2.WorkerInfo, b: worker_pb2.WorkerInfo) -> str | None:
    if a.layout != b.layout:
        diffs = [f"{f.name} {getattr(b.layout, f.name)!r} vs {getattr(a.layout, f.name)!r}"
                 for f in a.layout.DESCRIPTOR.fields if getattr(a.layout, f.name) != getattr(b.layout, f.name)]
        return (f"its KV layout differs from the tier's ({'; '.join(diffs)}); run every worker with the same "
                "model, dtype, --block-size, device and attention backend")
    if not set(a.transports) & set(b.transports):
        return f"no common KV transport ({list(a.transports)} vs {list(b.transports)})"
    if a.vocab_size != b.vocab_size or a.max_model_len != b.max_model_len:
        return (f"model limits differ (vocab size {b.vocab_size} vs {a.vocab_size}, max_model_len "
                f"{b.max_model_len} vs {a.max_model_len}); serve the same model with the same --max-model-len")
    return None
