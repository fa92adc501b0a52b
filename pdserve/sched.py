"""CPU scheduling for engines that share cores: a background engine yields to the others.

`pdserve up` runs both engines on all cores and puts the prefill engine in the background:
its compute threads run only when no decode (or gateway) thread wants the core, so decode
steps keep their pace while prefill soaks up every idle cycle.

Two knobs are needed on Linux. SCHED_IDLE on the engine's threads orders them below every
normal thread -- but only within one scheduling group: with autogroup on (the default on
desktop and many server kernels), each session is a group that competes at equal weight
whatever its threads' policy, so a worker in its own session (as `pdserve up` starts them)
also lowers its autogroup (to nice 10: see AUTOGROUP_NICE).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

SCHED_MODES = ("normal", "idle")
AUTOGROUP = "/proc/self/autogroup"
# The worker's whole session shares the autogroup, its gRPC server and /metrics too: at 19
# (weight 15 against 1024) they starved while decode ran, past a 5 s metrics scrape in the
# integration tests; at 10 (weight 110) the worker keeps about a tenth of a core.
AUTOGROUP_NICE = 10


def enter_background() -> None:
    """Makes this thread (and the processes and threads it starts from now on) idle-class."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if os.getsid(0) == os.getpid() and os.path.exists(AUTOGROUP):
        try:
            with open(AUTOGROUP, "w") as f:
                f.write(str(AUTOGROUP_NICE))
        except OSError as e:
            logger.warning("could not lower this worker's autogroup (%s); with autogroup on, "
                           "its engine competes with the others at equal weight", e)


def leave_background() -> None:
    """Back to the normal class for every thread of this process: the gRPC server's threads
    come from the calling one, and the engine's client started its own threads while in the
    background. The processes started meanwhile (the engine's) stay in the background.

    Only the calling thread was reset once, and a Python thread vLLM's engine client starts
    stayed idle-class inside the worker (with its ZMQ I/O threads): starved beside a busy
    decode engine while holding the GIL, it stalled the worker's gRPC server, which missed
    its health checks; seen in a closed loop of 4 short requests, the gateway took the
    prefill tier out and answered 130 of 160 requests UNAVAILABLE within 1.5 s."""
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except ProcessLookupError:
            pass  # the thread ended meanwhile
