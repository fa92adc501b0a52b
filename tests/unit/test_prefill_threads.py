"""kvtransfer.prefill_threads: one prefill thread while a decode engine on the cores steps."""

from __future__ import annotations

import os
import subprocess
import sys

from kvtransfer.coreshare import StepYield
from kvtransfer.prefill_threads import SOLO_WINDOW_S, DecodeBeat, PrefillThreads
from tests.unit.shm_words import Clock, base  # noqa: F401 - base is a fixture


def test_prefill_computes_on_one_thread_while_decode_steps_and_on_its_team_otherwise(base):
    clock, set_to = Clock(), []
    prefill = PrefillThreads(base, team=2, set_threads=set_to.append, clock=clock)
    assert prefill.step() == 2 and set_to == []  # no decode engine: the team, unchanged
    beat = DecodeBeat(base, clock=clock)
    assert os.path.basename(beat.path).startswith(os.path.basename(base) + ".d")
    beat.step_ended()  # an end without a start (an idle step) is not a step
    clock.now = 1.0  # the next scan finds the word
    assert prefill.step() == 2
    beat.step_started()
    assert prefill.step() == 1 and set_to == [1]  # in a step
    clock.now += 0.2
    assert prefill.step() == 1 and set_to == [1]  # still in it: no call to set again
    beat.step_ended()
    clock.now += SOLO_WINDOW_S - 0.001  # the next step is due any moment
    assert prefill.step() == 1
    clock.now += 0.002  # none came: decode idles
    assert prefill.step() == 2 and set_to == [1, 2]
    assert (prefill.solo_steps, prefill.team_steps) == (3, 3)
    beat.close()
    assert not os.path.exists(beat.path)


def test_a_decode_word_is_not_a_prefill_workers_and_a_dead_engines_word_stops_counting(base):
    """StepYield counts prefill words only; PrefillThreads drops the word of a decode
    engine whose process is gone (one killed inside a step does not hold prefill to one
    thread)."""
    clock = Clock()
    prefill = PrefillThreads(base, team=2, set_threads=lambda n: None, clock=clock)
    code = ("import sys, time; from kvtransfer.prefill_threads import DecodeBeat; "
            "b = DecodeBeat(sys.argv[1]); b.step_started(); print('in', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, base], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "in"
        assert prefill.step() == 1
        assert StepYield(base, 0.01, clock=clock).prefill_busy() == 0
    finally:
        child.kill()
        child.wait()
    clock.now = 1.0
    assert prefill.step() == 2
    DecodeBeat(base).close()


def test_always_computes_on_one_thread(base):
    set_to = []
    prefill = PrefillThreads(base, team=2, set_threads=set_to.append, always=True, clock=Clock())
    assert [prefill.step(), prefill.step()] == [1, 1] and set_to == [1]
