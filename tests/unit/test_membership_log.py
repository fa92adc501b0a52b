"""A worker's heartbeats to its gateway (pdserve/membership.py): an outage is logged once,
not once per beat, and its end once; a stopping worker's outage is no warning, and neither
is a blip of a beat or two (a stack told to stop: its gateway closed its port a moment before
its decode worker heard its own SIGTERM, and the worker warned)."""

import asyncio
import logging

import grpc
import pytest

from pdserve.membership import EngineLoad, InflightInterceptor, Membership
from protos import worker_pb2


class FlakyRegistry:
    """Heartbeat answers: UNAVAILABLE ``failures`` times, then fine; counts the calls."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.on_call = {}  # call number: what happens as it is answered


    async def Heartbeat(self, request, timeout):
        self.calls += 1
        self.on_call.get(self.calls, lambda: None)()
        if self.calls <= self.failures:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="failed to connect to all addresses")
        return worker_pb2.HeartbeatResponse()


async def beat(failures: int, then: int, draining: bool = False, drain_after: int | None = None) -> FlakyRegistry:
    member = Membership("127.0.0.1:1", worker_pb2.WorkerInfo(worker_id="w1", role="decode"), "127.0.0.1:2",
                        "", EngineLoad(), InflightInterceptor(), asyncio.Event())
    registry = FlakyRegistry(failures)
    if drain_after is not None:
        registry.on_call[drain_after] = member.start_draining
    member._stub = registry

    async def registered() -> None:
        member._interval_s = 0.001

    member._register = registered
    member.draining = draining
    task = asyncio.create_task(member.run())
    while registry.calls < failures + then:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await member._channel.close()
    return registry


def test_an_outage_is_logged_once_and_its_end_once(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.membership")
    asyncio.run(beat(failures=5, then=3))
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert [level for level, message in lines if "failing" in message] == ["WARNING"]
    assert [level for level, message in lines if "go through again" in message] == ["INFO"]


def test_a_stopping_worker_s_outage_is_no_warning(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.membership")
    asyncio.run(beat(failures=3, then=0, draining=True))
    assert [r.levelname for r in caplog.records if "failing" in r.getMessage()] == ["INFO"]


def test_a_blip_of_two_failed_beats_says_nothing(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.membership")
    asyncio.run(beat(failures=2, then=3))
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == []


def test_a_worker_told_to_stop_after_its_gateway_went_says_info(caplog):
    caplog.set_level(logging.INFO, logger="pdserve.membership")
    asyncio.run(beat(failures=4, then=0, drain_after=2))
    assert [r.levelname for r in caplog.records if "failing" in r.getMessage()] == ["INFO"]
