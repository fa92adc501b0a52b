"""gateway.workers' registry side: joining, refusal, heartbeats, drain, expiry (no servers:
Worker channels are opened lazily by grpc.aio and never used here)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.workers import WorkerPool
from protos import worker_pb2


def info(worker_id: str, role: str = "decode", block_size: int = 32, **kw) -> worker_pb2.WorkerInfo:
    return worker_pb2.WorkerInfo(worker_id=worker_id, role=role, vocab_size=100, max_model_len=4096,
                                 transports=kw.pop("transports", ["shm", "tcp"]),
                                 layout=worker_pb2.KvLayout(num_layers=30, block_size=block_size, dtype="float32"), **kw)


def run(fn):
    async def wrapped():
        pool = WorkerPool()
        try:
            return fn(pool)
        finally:
            await pool.close()
    return asyncio.run(wrapped())


def test_a_registered_worker_is_routable_at_once():
    def scenario(pool):
        pool.register(info("p1", "prefill"), "10.0.0.1:1", "", now_s=0.0)
        pool.register(info("d1"), "10.0.0.2:1", "http://10.0.0.2:9/metrics", now_s=0.0)
        return pool.ready(), [w.state for w in pool.workers], pool.by_id("d1").source

    assert run(scenario) == (True, ["ready", "ready"], "registered")


def test_an_incompatible_worker_is_refused_naming_what_differs():
    def scenario(pool):
        pool.register(info("d1"), "h1:1", "", now_s=0.0)
        with pytest.raises(ValueError) as e:
            pool.register(info("d2", block_size=64), "h2:1", "", now_s=0.0)
        with pytest.raises(ValueError, match="no common KV transport"):
            pool.register(info("d3", transports=["nccl"]), "h3:1", "", now_s=0.0)
        return str(e.value), len(pool.workers)

    message, count = run(scenario)
    assert "block_size 64 vs 32" in message and "decode worker d2 at h2:1 cannot join" in message
    assert count == 1


def test_a_restarted_worker_replaces_its_old_entry_with_a_fresh_channel():
    def scenario(pool):
        old = pool.register(info("old"), "h1:1", "", now_s=0.0)
        new = pool.register(info("new"), "h1:1", "", now_s=5.0)
        again = pool.register(info("new"), "h1:1", "", now_s=6.0)  # the same engine again: kept
        return [w.worker_id for w in pool.workers], new is not old, again is new

    assert run(scenario) == (["new"], True, True)


def test_missed_heartbeats_take_a_worker_out_of_rotation_and_later_forget_it():
    def scenario(pool):
        pool.register(info("d1"), "h1:1", "", now_s=0.0)
        pool.heartbeat("d1", worker_pb2.WorkerLoad(num_running=2), False, now_s=1.0)
        assert pool.expire_heartbeats(3.9, timeout_s=3.0) == []
        lost = [w.worker_id for w in pool.expire_heartbeats(4.1, timeout_s=3.0)]
        state = pool.by_id("d1").state
        pool.heartbeat("d1", worker_pb2.WorkerLoad(), False, now_s=5.0)  # back
        back = pool.by_id("d1").state
        pool.expire_heartbeats(36.0, timeout_s=3.0)  # silent for 10x the timeout: forgotten
        return lost, state, back, pool.workers

    assert run(scenario) == (["d1"], "down", "ready", [])


def test_a_pause_of_the_gateway_is_not_counted_as_the_workers_silence():
    def scenario(pool):
        pool.register(info("d1"), "h1:1", "", now_s=0.0)
        pool.register(info("d2"), "h2:1", "", now_s=0.0)
        pool.heartbeat("d1", worker_pb2.WorkerLoad(), False, now_s=1.0)
        pool.heartbeat("d2", worker_pb2.WorkerLoad(), False, now_s=1.0)
        # The gateway stopped from 1.5 to 301.5; d2's heartbeat was read as it resumed.
        pool.heartbeat("d2", worker_pb2.WorkerLoad(), False, now_s=301.6)
        excused = pool.excuse_pause(300.0, now_s=301.7)
        kept = [w.worker_id for w in pool.expire_heartbeats(303.9, timeout_s=3.0)]
        times = [w.last_heartbeat_s for w in pool.workers]
        lost = [w.worker_id for w in pool.expire_heartbeats(304.1, timeout_s=3.0)]
        return excused, kept, times, lost

    # d1 last spoke 0.5 s before the pause: silent 2.9 s at 303.9 and 3.1 s at 304.1 once
    # the pause is excused (without it, 302.9 s: out of rotation and forgotten at once).
    assert run(scenario) == (2, [], [301.0, 301.7], ["d1"])


def test_drain_takes_a_worker_out_of_rotation_and_tells_it_in_the_next_heartbeat():
    def scenario(pool):
        pool.register(info("d1"), "h1:1", "", now_s=0.0)
        assert pool.heartbeat("d1", worker_pb2.WorkerLoad(), False, now_s=0.5) is False
        pool.drain("d1")
        told = pool.heartbeat("d1", worker_pb2.WorkerLoad(), True, now_s=1.0)
        return told, pool.by_id("d1").state, pool.routable("decode"), pool.deregister("d1").worker_id, pool.workers

    assert run(scenario) == (True, "draining", [], "d1", [])


def test_unknown_ids_raise_key_error():
    def scenario(pool):
        with pytest.raises(KeyError):
            pool.heartbeat("ghost", worker_pb2.WorkerLoad(), False, now_s=0.0)
        with pytest.raises(KeyError):
            pool.drain("ghost")
        return pool.deregister("ghost")

    assert run(scenario) is None


def test_a_restarted_worker_at_the_same_address_answers_at_once():
    """The old engine's channel sits in reconnect backoff; the new one's first call must not
    inherit it (gRPC shares subchannels between channels unless told not to)."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from pdserve import rpc
    from pdserve.launcher import free_port

    async def scenario():
        address = f"127.0.0.1:{free_port()}"
        pool = WorkerPool()
        old = pool.register(info("old"), address, "", now_s=0.0)
        server = None
        try:
            down = [await rpc.check_health(old.channel) for _ in range(4)]
            # register() closes the old channel in the background: keep it open meanwhile,
            # as it was when a request followed the registration at once.
            pool.workers.remove(old)
            server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
            server.add_insecure_port(address)
            await server.start()
            new = pool.register(info("new"), address, "", now_s=1.0)
            return down, await rpc.check_health(new.channel)
        finally:
            await pool.close()
            await old.channel.close()
            if server is not None:
                await server.stop(0)

    assert asyncio.run(scenario()) == ([False] * 4, True)


def test_polling_survives_a_worker_whose_channel_was_closed():
    async def scenario():
        pool = WorkerPool()
        try:
            worker = pool.register(info("d1"), "127.0.0.1:1", "", now_s=0.0)
            await worker.channel.close()  # as register() does to a replaced worker's channel
            await pool.poll_once()
            return worker.healthy
        finally:
            await pool.close()

    assert asyncio.run(scenario()) is False


def test_health_status_tells_a_late_answer_from_none():
    """A health check past its deadline is NO_ANSWER (alive or not); nothing listening is
    NOT_SERVING, as is a server that says so."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdserve import rpc
    from pdserve.launcher import free_port

    class Slow(health_pb2_grpc.HealthServicer):
        async def Check(self, request, context):
            await asyncio.sleep(1.0)
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def scenario():
        address = f"127.0.0.1:{free_port()}"
        nobody = grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}")
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Slow(), server)
        server.add_insecure_port(address)
        await server.start()
        channel = grpc.aio.insecure_channel(address)
        try:
            return (await rpc.health_status(channel, timeout_s=0.2),
                    await rpc.health_status(channel, timeout_s=3.0),
                    await rpc.health_status(nobody, timeout_s=1.0))
        finally:
            await channel.close()
            await nobody.close()
            await server.stop(0)

    assert asyncio.run(scenario()) == (rpc.Health.NO_ANSWER, rpc.Health.SERVING, rpc.Health.NOT_SERVING)


def test_a_worker_leaves_rotation_after_three_unanswered_health_checks_or_one_refusal(monkeypatch):
    """Late answers from a busy host keep a worker in rotation up to the third in a row; an
    answer in between starts the count again; NOT_SERVING takes it out at once."""
    from gateway.workers import HEALTH_CHECKS_UNANSWERED_DOWN
    from pdserve import rpc

    assert HEALTH_CHECKS_UNANSWERED_DOWN == 3
    script: list[rpc.Health] = []

    async def scripted(channel, service="", timeout_s=2.0):
        return script.pop(0)

    monkeypatch.setattr(rpc, "health_status", scripted)
    S, N, X = rpc.Health.SERVING, rpc.Health.NO_ANSWER, rpc.Health.NOT_SERVING

    async def scenario():
        pool = WorkerPool.connect(("10.0.0.9:1",), ())
        worker = pool.workers[0]

        class Stub:  # a worker coming back is asked for its Info again
            async def Info(self, request, timeout=None):
                return info("p1", "prefill")

        worker.stub = Stub()
        seen = []
        try:
            for status in (S, N, N, S, N, N, N, S, X):
                script.append(status)
                await pool.poll_once()
                seen.append(worker.healthy)
            return seen
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == [True, True, True, True, True, True, False, True, False]


class FakeHealth:
    """grpc_health's aio servicer as the gateway uses it: the last status set per service."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}

    async def set(self, service: str, status: int) -> None:
        self.status[service] = status


def test_the_gateway_health_follows_registrations_at_once_not_at_the_next_poll_round():
    from grpc_health.v1 import health_pb2

    from gateway.registry import RegistryServicer
    from gateway.serving import SERVICE_NAME, Serving

    async def scenario():
        pool, health = WorkerPool(), FakeHealth()
        serving, pumps = Serving(health, pool), []

        async def changed():
            pumps.append(len(pool.workers))
            await serving.refresh()

        registry = RegistryServicer(pool, 1.0, changed, clock=lambda: 0.0)
        seen = []
        try:
            await serving.refresh()
            seen.append(health.status[SERVICE_NAME])
            for worker_id, role, address in (("p1", "prefill", "h1:1"), ("d1", "decode", "h2:1")):
                await registry.Register(worker_pb2.RegisterRequest(info=info(worker_id, role), address=address),
                                        None)
                seen.append(health.status[SERVICE_NAME])
            await registry.Drain(worker_pb2.DrainRequest(worker_id="d1"), None)
            seen.append(health.status[SERVICE_NAME])
            await registry.Register(worker_pb2.RegisterRequest(info=info("d2"), address="h3:1"), None)
            seen.append((health.status[SERVICE_NAME], health.status[""]))
            await registry.Deregister(worker_pb2.DeregisterRequest(worker_id="p1"), None)
            seen.append(health.status[SERVICE_NAME])
        finally:
            await pool.close()
        return seen, pumps

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    seen, pumps = asyncio.run(scenario())
    # Serving needs a decode worker, not a prefill worker (decode then prefills every prompt).
    assert seen == [not_serving, not_serving, serving, not_serving, (serving, serving), serving]
    assert pumps == [1, 2, 2, 3, 2]  # the dispatcher is told of each change


def test_a_heartbeat_that_brings_a_worker_back_sets_health_at_once_and_a_routine_one_changes_nothing():
    from grpc_health.v1 import health_pb2

    from gateway.registry import RegistryServicer
    from gateway.serving import SERVICE_NAME, Serving

    async def scenario():
        pool, health = WorkerPool(), FakeHealth()
        serving, pumps = Serving(health, pool), []

        async def changed():
            pumps.append([w.state for w in pool.workers if w.worker_id == "d1"])
            await serving.refresh()

        registry = RegistryServicer(pool, 1.0, changed, clock=lambda: 0.0)
        seen = []
        try:
            for worker_id, role in (("p1", "prefill"), ("d1", "decode")):
                await registry.Register(worker_pb2.RegisterRequest(info=info(worker_id, role), address=f"{worker_id}:1"),
                                        None)
            pumps.clear()
            beat = worker_pb2.HeartbeatRequest(worker_id="d1", load=worker_pb2.WorkerLoad(num_running=1))
            await registry.Heartbeat(beat, None)  # routine: nothing changes
            seen.append((health.status[SERVICE_NAME], list(pumps)))
            pool.expire_heartbeats(10.0, timeout_s=3.0)  # the poll loop's expiry: both down
            await serving.refresh()
            seen.append(health.status[SERVICE_NAME])
            await registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="p1"), None)  # p1 back
            seen.append((health.status[SERVICE_NAME], list(pumps)))
            await registry.Heartbeat(beat, None)  # d1 back: health at once, dispatcher told
            seen.append((health.status[SERVICE_NAME], list(pumps)))
        finally:
            await pool.close()
        return seen

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(scenario()) == [(serving, []), not_serving, (not_serving, [["down"]]),
                                       (serving, [["down"], ["ready"]])]


def test_a_stopping_gateway_stays_not_serving_while_its_workers_heartbeat_and_register():
    """The gateway's drain keeps its registry open (the workers that serve its queued calls
    heartbeat on), yet a heartbeat or a registration must not turn it SERVING again."""
    from grpc_health.v1 import health_pb2

    from gateway.registry import RegistryServicer
    from gateway.serving import SERVICE_NAME, Serving

    async def scenario():
        pool, health = WorkerPool(), FakeHealth()
        serving = Serving(health, pool)
        registry = RegistryServicer(pool, 1.0, serving.refresh, clock=lambda: 0.0)
        seen = []
        try:
            await registry.Register(worker_pb2.RegisterRequest(info=info("d1"), address="d1:1"), None)
            seen.append(health.status[SERVICE_NAME])
            await serving.stop()
            seen.append(health.status[SERVICE_NAME])
            await registry.Heartbeat(worker_pb2.HeartbeatRequest(worker_id="d1"), None)
            await registry.Deregister(worker_pb2.DeregisterRequest(worker_id="d1"), None)
            await registry.Register(worker_pb2.RegisterRequest(info=info("d2"), address="d2:1"), None)
            await serving.refresh()
            seen.append((health.status[SERVICE_NAME], [w.worker_id for w in pool.routable("decode")]))
        finally:
            await pool.close()
        return seen

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(scenario()) == [serving, not_serving, (not_serving, ["d2"])]


def test_no_prefill_worker_at_a_stacks_start_or_after_a_drain_is_info_and_losing_the_tier_warns(caplog):
    """A stack's decode worker often registers before its prefill worker: serving without a
    tier then is routine (INFO), and so is the tier draining away (an operator's drain, a
    stack stopping: CI saw `pdserve up` stopped by Ctrl-C warn of it). The tier lost to a
    failure (heartbeats missed) is news (WARNING), once."""
    from gateway.registry import RegistryServicer
    from gateway.serving import Serving

    async def scenario():
        pool = WorkerPool()
        serving = Serving(FakeHealth(), pool)
        registry = RegistryServicer(pool, 1.0, serving.refresh, clock=lambda: 0.0)
        try:
            for worker_id, role in (("d1", "decode"), ("p1", "prefill")):
                await registry.Register(worker_pb2.RegisterRequest(info=info(worker_id, role), address=f"{worker_id}:1"),
                                        None)
            await registry.Deregister(worker_pb2.DeregisterRequest(worker_id="p1"), None)
            await registry.Register(worker_pb2.RegisterRequest(info=info("p2", "prefill"), address="p2:1"), None)
            pool.by_id("d1").last_heartbeat_s = 5.0  # only p2 falls silent
            pool.expire_heartbeats(5.0, 3.0)
            await serving.refresh()
            await serving.refresh()  # the next poll round: said once
        finally:
            await pool.close()

    with caplog.at_level(logging.INFO, logger="gateway.serving"):
        asyncio.run(scenario())
    said = [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records
            if r.name == "gateway.serving" and "prefill worker" in r.getMessage()]
    assert said == [("INFO", "no prefill worker in rotation yet"),
                    ("INFO", "a prefill worker is in rotation"),
                    ("INFO", "no prefill worker in rotation (the tier drained)"),
                    ("INFO", "a prefill worker is in rotation"),
                    ("WARNING", "no prefill worker in rotation")]


def test_a_pause_excuses_no_static_worker():
    """Static workers are polled, not heard from: a paused gateway with only those has no
    heartbeat silence to excuse (its log then names none)."""
    async def scenario():
        pool = WorkerPool.connect(("127.0.0.1:1",), ("127.0.0.1:2",))
        try:
            return pool.excuse_pause(30.0, now_s=31.0), [w.source for w in pool.workers]
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == (0, ["static", "static"])
