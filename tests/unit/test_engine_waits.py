"""kvtransfer.engine_waits: the patches of vLLM's SpinCondition."""

from __future__ import annotations

from types import SimpleNamespace

def test_engine_waits_sleep_between_looks_instead_of_spinning(monkeypatch):
    """vLLM's SpinCondition loops on sched_yield for a second after a read; installed (on
    request), a
    wait right after a read sleeps QUIET_POLL_S, and one after the second still sleeps on
    the notification socket's poll."""
    import time as real_time

    from vllm.distributed.device_communicators import shm_broadcast

    from kvtransfer import engine_waits

    monkeypatch.delenv(engine_waits.ENV_ENGINE_QUIET, raising=False)
    assert engine_waits.quiet_engine_waits() is False  # off unless asked for
    monkeypatch.setenv(engine_waits.ENV_ENGINE_QUIET, "1")
    assert engine_waits.quiet_engine_waits() is True
    slept, yielded, polled = [], [], []
    monkeypatch.setattr(engine_waits.time, "sleep", slept.append)
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: yielded.append(1))
    reader = SimpleNamespace(is_reader=True, busy_loop_s=1.0, last_read=real_time.monotonic(),
                             read_cancel_socket="cancel", local_notify_socket="notify",
                             poller=SimpleNamespace(poll=lambda timeout: polled.append(timeout) or []))
    shm_broadcast.SpinCondition.wait(reader, timeout_ms=7)
    assert slept == [engine_waits.QUIET_POLL_S] and yielded == [] and polled == []
    reader.last_read -= 2.0  # idle for more than the busy loop's second
    shm_broadcast.SpinCondition.wait(reader, timeout_ms=7)
    assert polled == [7] and yielded == [] and len(slept) == 1



def test_an_engine_wait_spins_at_most_its_bound_then_sleeps_on_the_notification(monkeypatch, caplog):
    """vLLM's SpinCondition spins for a second after each read; bounded, one wait spins
    (vLLM's own look) for at most PDSERVE_ENGINE_SPIN_S from its first look, then polls the
    notification socket, and a read starts the count again."""
    from vllm.distributed.device_communicators import shm_broadcast

    from kvtransfer import engine_waits

    condition = shm_broadcast.SpinCondition
    looks = []
    monkeypatch.setattr(condition, "wait", lambda self, timeout_ms=None: looks.append(timeout_ms))
    monkeypatch.setattr(condition, "_pdserve_spin_s", None, raising=False)
    monkeypatch.setenv(engine_waits.ENV_ENGINE_SPIN_S, "1")
    assert engine_waits.bound_engine_spin() is None  # vLLM's second
    assert not caplog.records
    for bad in ("x", "-1", "nan"):
        monkeypatch.setenv(engine_waits.ENV_ENGINE_SPIN_S, bad)
        assert engine_waits.bound_engine_spin() is None
        assert f"PDSERVE_ENGINE_SPIN_S={bad!r} is not a number of seconds >= 0" in caplog.records[-1].getMessage()
    assert len(caplog.records) == 3
    monkeypatch.delenv(engine_waits.ENV_ENGINE_SPIN_S)
    assert engine_waits.bound_engine_spin() == engine_waits.ENGINE_SPIN_S == 0.2  # the default
    assert engine_waits.bound_engine_spin() == 0.2  # once

    now = [100.05]
    monkeypatch.setattr(engine_waits, "time", SimpleNamespace(monotonic=lambda: now[0]))
    polled, received = [], []
    class Socket:  # hashable, as zmq's: the poll's events are a dict by socket
        def recv(self, flags, copy):
            received.append(flags)

    notify = Socket()
    events = []
    reader = SimpleNamespace(busy_loop_s=1.0, last_read=100.0, local_notify_socket=notify,
                             poller=SimpleNamespace(poll=lambda timeout: polled.append(timeout) or events))

    def wait_at(t):
        now[0] = t
        condition.wait(reader, timeout_ms=7)

    wait_at(100.05)  # first look of this wait
    wait_at(100.24)  # within 0.2 s of it: still vLLM's look
    assert looks == [7, 7] and polled == []
    wait_at(100.26)
    assert looks == [7, 7] and polled == [7] and received == []
    events.append((notify, 1))
    wait_at(100.30)
    assert polled == [7, 7] and len(received) == 1  # the notification is taken off
    reader.last_read = 100.31  # a message was read: the next wait counts afresh
    wait_at(100.40)
    wait_at(100.59)
    assert looks == [7, 7, 7, 7] and len(polled) == 2
    wait_at(100.61)
    assert len(polled) == 3 and len(looks) == 4
