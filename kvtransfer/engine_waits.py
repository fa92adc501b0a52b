"""How an engine's two processes wait for each other's messages on cores shared by two engines.

A CPU engine run with `--executor mp` (vLLM's multiprocess executor, its choice on CPUs; pdserve's
default is uni, pdserve.engine.computes_in_engine_core) computes in a model-worker process
beside its engine-core process, and each waits for the other's messages on a
shared-memory queue by looping on sched_yield for a second after its last read
(`SpinCondition.busy_loop_s`) before it sleeps on a zmq notification. Both patches here
change that loop for every queue of the process (the KV connector installs them on import,
which happens in both of an engine's processes; on a GPU neither applies):
`bound_engine_spin` (on by default) and `quiet_engine_waits` (opt-in, measured worse).
"""

from __future__ import annotations

import logging
import math
import os
import time

logger = logging.getLogger(__name__)

# Set (to anything but 0) to have vLLM's processes of an engine sleep between looks at each
# other's queue instead of spinning (`quiet_engine_waits`; off: measured worse).
ENV_ENGINE_QUIET = "PDSERVE_ENGINE_QUIET"
QUIET_POLL_S = 0.0002
# Seconds one wait of an engine's process for the other's message may spin before it sleeps
# on vLLM's notification (`bound_engine_spin`); vLLM spins for a second after each read.
# 1 or more: vLLM's own behaviour. A running engine's waits are shorter than a decode step
# (tens of milliseconds; under 100 ms at the short benchmark's highest rates).
ENV_ENGINE_SPIN_S = "PDSERVE_ENGINE_SPIN_S"
ENGINE_SPIN_S = 0.2


def quiet_engine_waits() -> bool:
    """vLLM's processes of one engine wait for each other without spinning; True when
    installed (now or before).

    A CPU engine runs its model in a worker process beside its engine-core process (vLLM
    uses the multiprocess executor on CPU), and each waits for the other's messages on a
    shared-memory queue by looping on sched_yield for a second after its last read
    (`SpinCondition.busy_loop_s`) before it sleeps on a zmq notification: the engine-core
    process spins on a core for as long as its worker computes (docs/benchmarks.md measured
    it at 14 of 30 s). On cores shared by two engines that spinner runs at normal priority
    beside the idle-priority prefill engine, whose OpenMP team then waits at each barrier
    for the thread it displaced, and it spins on while decode pauses for prefill.
    Installed, the loop sleeps QUIET_POLL_S between its looks instead of yielding (a step
    learns of its input at most that much later, against steps of tens of milliseconds);
    after the second it still sleeps on the notification as vLLM does. Sleeping on the
    notification at once was tried first and measured far worse: decode's TPOT p50 went
    from about 50 to 367 ms (wake-ups late or lost). The sleeping loop measured worse too
    (short workload at 2 req/s, back to back: TPOT p50 106 ms against 88 ms spinning), so
    it is off unless PDSERVE_ENGINE_QUIET is set, and off on GPUs whatever the setting.
    Patches the class, so queues made before the call wait quietly too; the KV connector
    calls it on import, which happens in both of an engine's processes."""
    if os.environ.get(ENV_ENGINE_QUIET, "0") in ("", "0"):
        return False
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    condition = shm_broadcast.SpinCondition
    if getattr(condition, "_pdserve_quiet", False):
        return True
    spinning_wait = condition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(QUIET_POLL_S)
        else:
            spinning_wait(self, timeout_ms)

    condition.wait = wait
    condition._pdserve_quiet = True
    return True


def bound_engine_spin() -> float | None:
    """One wait of an engine's process for the other's next message spins at most
    PDSERVE_ENGINE_SPIN_S seconds, then sleeps on vLLM's notification socket; the bound in
    force, or None when vLLM's own behaviour stands (a bound of 1 s or more, a GPU, no vLLM).

    vLLM's `SpinCondition` loops on sched_yield for a second after each read, whatever
    happens: when the decode engine finishes its last request, its model worker spins at
    normal priority for that second on a core it shares with the idle-priority prefill
    engine, whose OpenMP team waits at each barrier for the thread it displaced; a prompt
    that waited on the tier while decode ran waits that second longer (measured with
    `ROUNDS=2 scripts/idle_spin_probe.sh PDSERVE_ENGINE_SPIN_S=1 PDSERVE_ENGINE_SPIN_S=0.2`:
    a 1,400-token prompt sent to the tier during a 64-token decode reached its first token
    2.24 and 2.21 s after decode's last token with vLLM's second, 1.47 and 1.32 s with the
    bound of 0.2 s, against 1.21-1.31 s with decode idle). Bounding each wait
    (counted from its first look, not from the last read) leaves the hot path as it was: a
    running engine's waits last a step or the scheduler's turn between steps, well under the
    bound; a wait longer than the bound (an idle engine, a step that prefills a long prompt)
    sleeps on the notification, which the writer sends with every message. Patches the
    class, so queues made before the call are bounded too; the KV connector calls it on
    import, in each of an engine's processes."""
    text = os.environ.get(ENV_ENGINE_SPIN_S, str(ENGINE_SPIN_S))
    try:
        spin_s = float(text)
    except ValueError:
        spin_s = math.nan
    if not spin_s >= 0:
        logger.warning("%s=%r is not a number of seconds >= 0: this engine spins as vLLM does "
                       "(a second after each read)", ENV_ENGINE_SPIN_S, text)
        return None
    if spin_s >= 1.0:
        return None
    try:
        from vllm.distributed.device_communicators import shm_broadcast
        from vllm.platforms import current_platform
    except ImportError:
        return None
    if not current_platform.is_cpu():
        return None
    condition = shm_broadcast.SpinCondition
    if getattr(condition, "_pdserve_spin_s", None) is not None:
        return condition._pdserve_spin_s
    unbounded_wait = condition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        now = time.monotonic()
        if getattr(self, "_pdserve_after_read", None) != self.last_read:
            self._pdserve_after_read, self._pdserve_waiting_since = self.last_read, now
        if now - self._pdserve_waiting_since <= spin_s:
            unbounded_wait(self, timeout_ms)
            return
        events = dict(self.poller.poll(timeout=timeout_ms))
        if self.local_notify_socket in events:
            # vLLM's idle branch: the socket is conflated, one message at most.
            import zmq

            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    condition.wait = wait
    condition._pdserve_spin_s = spin_s
    return spin_s
