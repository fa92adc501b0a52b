import os
import threading

import pytest

from pdserve import sched


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")
def test_leaving_the_background_returns_every_thread_of_the_process_to_normal():
    """Threads started in the background (as vLLM's engine client starts its own) leave it
    with the thread that called: only the processes started meanwhile stay idle-class."""
    done = threading.Event()
    policies = []
    try:
        # Idle class for this thread only, as enter_background does (without its autogroup,
        # which would lower the whole test session).
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        started = threading.Thread(target=done.wait)
        started.start()
        policies.append(os.sched_getscheduler(started.native_id))
        sched.leave_background()
        policies.append(os.sched_getscheduler(started.native_id))
        policies.append(os.sched_getscheduler(0))
    finally:
        done.set()
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    assert policies == [os.SCHED_IDLE, os.SCHED_OTHER, os.SCHED_OTHER]
