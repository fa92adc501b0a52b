"""pdserve.worker: a worker whose engine died stops itself (to be restarted) rather than
serve EngineDeadError to every request; a live engine keeps it running."""

from __future__ import annotations

import asyncio

from pdserve import worker


class FakeEngine:
    def __init__(self) -> None:
        self.errored = False


def test_a_dead_engine_stops_the_worker_and_marks_it_died(monkeypatch):
    monkeypatch.setattr(worker, "ENGINE_CHECK_S", 0.01)

    async def scenario():
        engine, stop, died = FakeEngine(), asyncio.Event(), asyncio.Event()
        watch = asyncio.create_task(worker._watch_engine(engine, stop, died))
        await asyncio.sleep(0.05)
        alive = (stop.is_set(), died.is_set())
        engine.errored = True
        await asyncio.wait_for(watch, 1.0)
        return alive, (stop.is_set(), died.is_set())

    assert asyncio.run(scenario()) == ((False, False), (True, True))


def test_a_stop_for_another_reason_ends_the_watch_without_marking_death(monkeypatch):
    monkeypatch.setattr(worker, "ENGINE_CHECK_S", 0.01)

    async def scenario():
        stop, died = asyncio.Event(), asyncio.Event()
        watch = asyncio.create_task(worker._watch_engine(FakeEngine(), stop, died))
        stop.set()
        await asyncio.wait_for(watch, 1.0)
        return died.is_set()

    assert asyncio.run(scenario()) is False
