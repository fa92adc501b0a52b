"""kvtransfer.coreshare: the prefill workers' counts of prompts in hand, and the decode
engine's yield that sums them (real /dev/shm words; other workers as child processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtransfer.coreshare import (ENV_FILE, ENV_YIELD_MS, NEVER, SLACK_SLICE_MAX_S, WHOLE_MAX_S, WHOLE_POLL_S, BestRate,
                                  PrefillBusy, StepPace, StepYield, pace_budget_s, pause_budget_s, budget_mode_from_env,
                                  urgent_at)
from tests.unit.shm_words import Clock, base  # noqa: F401 - base is a fixture


def test_decode_yields_only_while_prefill_has_prompts_in_hand(base):
    slept, clock = [], Clock()
    decode = StepYield(base, 0.015, sleep=slept.append, clock=clock)
    assert decode.pause() == 0.0  # no prefill worker yet: no word, nothing in hand
    busy = PrefillBusy(base)
    assert decode.pause() == 0.0  # not seen until the next scan, and empty anyway
    busy.enter()
    busy.enter()
    assert decode.prefill_busy() == 0  # a second has not passed: the word is not known yet
    clock.now = 1.0
    assert decode.prefill_busy() == 2 and decode.pause() == 0.015
    busy.leave()
    assert decode.pause(budget_s=0.0) == 0.015  # a fixed slice takes no budget
    busy.leave()
    busy.leave()  # never below zero
    assert decode.prefill_busy() == 0 and decode.pause() == 0.0
    assert slept == [0.015, 0.015]
    busy.close()
    assert not os.path.exists(busy.path)


def test_words_of_several_workers_add_up_and_a_dead_one_stops_counting(base):
    """Another prefill worker (a child process) holds 3 prompts and is killed holding them:
    decode stops counting them at the next scan."""
    clock = Clock()
    decode = StepYield(base, 0.01, sleep=lambda s: None, clock=clock)
    mine = PrefillBusy(base)
    mine.enter()
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from kvtransfer.coreshare import PrefillBusy\n"
         f"b = PrefillBusy({base!r}); [b.enter() for _ in range(3)]; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        assert other.stdout.readline().strip() == "ready"
        clock.now = 1.0
        assert decode.prefill_busy() == 4
        other.kill()
        other.wait()
        assert decode.prefill_busy() == 4  # until the next scan
        clock.now = 2.0
        assert decode.prefill_busy() == 1
    finally:
        other.kill()
        other.wait()
        mine.close()


def test_from_env_needs_both_the_base_and_a_positive_yield(base, monkeypatch):
    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.setenv(ENV_YIELD_MS, "15")
    assert StepYield.from_env() is None and PrefillBusy.from_env() is None
    monkeypatch.setenv(ENV_FILE, base)
    assert StepYield.from_env().yield_s == pytest.approx(0.015)
    monkeypatch.setenv(ENV_YIELD_MS, "slack")
    assert StepYield.from_env().yield_s is None and budget_mode_from_env() == "slack"
    monkeypatch.setenv(ENV_YIELD_MS, "pace")
    pace = StepYield.from_env()
    assert pace.yield_s is None and not pace.whole and budget_mode_from_env() == "pace"
    monkeypatch.setenv(ENV_YIELD_MS, "whole")
    whole = StepYield.from_env()
    assert whole.whole and whole.yield_s is None and budget_mode_from_env() is None
    monkeypatch.setenv(ENV_YIELD_MS, "0")
    assert StepYield.from_env() is None and budget_mode_from_env() is None
    busy = PrefillBusy.from_env()
    assert busy is not None and os.path.getsize(f"{base}.{os.getpid()}") == 24
    busy.close()


def test_slack_budget_is_a_share_of_the_smallest_lead():
    # (tokens made, TPOT objective, first token seen at, most tokens); now = 10.0
    # r1: 11 tokens at 0.1 s since 9.0: due by 10.0 for its 11th, made it: lead 0.0.
    # r2: 21 tokens at 0.1 s since 8.5: lead 2.0 - 1.5 = 0.5 s -> 0.8 x 0.5 = 0.4.
    # r3: 41 tokens at 0.05 s since 9.0: lead 2.0 - 1.0 = 1.0 s.
    assert pause_budget_s(10.0, [(21, 0.1, 8.5, None), (41, 0.05, 9.0, None)]) == pytest.approx(0.4)
    assert pause_budget_s(10.0, [(21, 0.1, 8.5, None), (11, 0.1, 9.0, None)]) == 0.0
    # Behind schedule: no pause (never negative).
    assert pause_budget_s(10.0, [(3, 0.1, 9.0, None)]) == 0.0
    # A request still waiting for its first token, or one without an objective: none.
    assert pause_budget_s(10.0, [(21, 0.1, 8.5, None), (0, 0.1, None, None)]) == 0.0
    assert pause_budget_s(10.0, [(21, 0.1, 8.5, None), (5, None, 9.9, None)]) == 0.0
    # Its first token seen only now: no lead yet.
    assert pause_budget_s(10.0, [(21, 0.1, 8.5, None), (1, 0.1, 10.0, None)]) == 0.0
    # Far ahead: capped at the longest slice; nothing running: no pause.
    assert pause_budget_s(10.0, [(1001, 0.1, 0.0, None)]) == pytest.approx(SLACK_SLICE_MAX_S)
    assert pause_budget_s(10.0, []) == 0.0


def test_slack_budget_counts_the_tokens_still_to_come_at_the_measured_pace():
    """The SLO holds the mean time per token, so a request's last token may come as late as
    first + objective x (max_tokens - 1): the tokens still to come, at the engine's pace,
    add objective - pace each."""
    # r1: 11 of 51 tokens at 0.1 s since 9.0: lead 0.0; 40 to come at 0.09 s: +0.4 -> 0.32.
    assert pause_budget_s(10.0, [(11, 0.1, 9.0, 51)], step_s=0.09) == pytest.approx(0.32)
    # The smallest budget wins: r2 (21 of 31 since 8.5, lead 0.5) has 10 to come: +0.1.
    assert pause_budget_s(10.0, [(11, 0.1, 9.0, 51), (21, 0.1, 8.5, 31)], step_s=0.09) == pytest.approx(0.32)
    assert pause_budget_s(10.0, [(11, 0.1, 9.0, 31), (21, 0.1, 8.5, 31)], step_s=0.09) == pytest.approx(0.16)
    # A pace slower than the objective adds nothing (never takes away: the lead stands).
    assert pause_budget_s(10.0, [(21, 0.1, 8.5, 51)], step_s=0.2) == pytest.approx(0.4)
    # Pace or length unknown: the lead alone.
    assert pause_budget_s(10.0, [(11, 0.1, 9.0, 51)], step_s=None) == 0.0
    assert pause_budget_s(10.0, [(11, 0.1, 9.0, None)], step_s=0.09) == 0.0
    # Behind schedule by more than the tokens to come can make up: none.
    assert pause_budget_s(10.0, [(3, 0.1, 9.0, 13)], step_s=0.09) == 0.0


def test_pace_budget_is_a_share_of_what_the_tightest_objective_leaves_over_the_step():
    # (made, objective, first seen, max tokens): leads and lengths do not matter here.
    running = [(5, 0.080, 0.0, 100), (40, 0.070, 0.0, 50)]
    assert pace_budget_s(running, 0.050) == pytest.approx(0.7 * 0.020)
    assert pace_budget_s(running, None) == 0.0  # pace unknown
    assert pace_budget_s(running, 0.075) == 0.0  # the step alone is past the 70 ms one
    assert pace_budget_s([], 0.050) == 0.0
    assert pace_budget_s([*running, (0, 0.080, None, 10)], 0.050) == 0.0  # first token due
    assert pace_budget_s([*running, (3, None, 0.0, 10)], 0.050) == 0.0  # no objective
    assert pace_budget_s([(5, 2.0, 0.0, 10)], 0.050) == pytest.approx(0.5)  # at most 500 ms


def test_step_pace_times_plain_steps_only():
    pace = StepPace(alpha=0.5, max_gap_s=1.0)
    pace.observe(0.0, plain=True)
    assert pace.step_s is None  # one build: no length yet
    pace.observe(0.04, plain=False)  # the plain step took 0.04
    assert pace.step_s == pytest.approx(0.04)
    pace.observe(0.5, plain=True)  # the step before was not plain (a prompt, or a pause)
    assert pace.step_s == pytest.approx(0.04)
    pace.observe(0.56, plain=True)  # 0.06: halfway with alpha 0.5
    assert pace.step_s == pytest.approx(0.05)
    pace.observe(5.0, plain=True)  # the engine sat idle between steps: not a step's length
    assert pace.step_s == pytest.approx(0.05)


def test_slack_mode_waits_for_prefill_within_the_budget_and_skips_crumbs(base):
    clock, busy = Clock(), PrefillBusy(base)
    polls = []

    def sleep(s):
        polls.append(s)
        clock.now += s

    decode = StepYield(base, None, sleep=sleep, clock=clock)
    busy.enter()
    clock.now = 1.0
    assert decode.pause(0.03) == pytest.approx(0.03)  # prefill stays busy: the whole budget
    assert decode.pause(5.0) == pytest.approx(SLACK_SLICE_MAX_S)
    assert decode.pause(0.0005) == 0.0  # under a millisecond: not worth a sleep
    n = len(polls)
    busy.leave()
    assert decode.pause(0.03) == 0.0 and len(polls) == n  # prefill has nothing in hand
    assert max(polls) <= WHOLE_POLL_S
    busy.close()


def test_whole_mode_waits_for_one_prompt_at_a_time(base):
    """Decode waits, polling, while the prefill worker holds two prompts: until the first is
    done (3 polls), then makes its step; at the next step until the second is done (4 more
    polls); not at all while none is in hand."""
    clock, busy = Clock(), PrefillBusy(base)
    polls = []

    def sleep(s):
        polls.append(s)
        clock.now += s
        if len(polls) in (3, 7):
            busy.leave()

    decode = StepYield(base, None, sleep=sleep, clock=clock, whole=True)
    clock.now = 1.0
    assert decode.pause() == 0.0 and polls == []  # nothing in hand
    busy.enter()
    busy.enter()
    clock.now = 2.0
    assert decode.pause(budget_s=0.0) == pytest.approx(3 * WHOLE_POLL_S)  # takes no budget
    busy.enter()  # a third comes: the next step still waits for one to be done, no more
    assert decode.pause() == pytest.approx(4 * WHOLE_POLL_S)
    assert polls == [WHOLE_POLL_S] * 7
    busy.leave()
    assert decode.pause() == 0.0 and len(polls) == 7
    busy.close()


def test_whole_mode_gives_up_after_the_longest_wait(base):
    """A prefill worker that never empties holds decode up WHOLE_MAX_S per step, no more."""
    clock, busy = Clock(), PrefillBusy(base)
    busy.enter()

    def sleep(s):
        clock.now += s

    decode = StepYield(base, None, sleep=sleep, clock=clock, whole=True)
    clock.now = 1.0
    waited = decode.pause()
    assert WHOLE_MAX_S <= waited < WHOLE_MAX_S + WHOLE_POLL_S + 1e-9
    assert decode.pause() == pytest.approx(waited)  # the next step waits again
    busy.close()


def test_a_prompt_is_urgent_once_its_ttft_objective_leaves_only_its_prefill_on_every_core():
    # 4 s left, 1,000 tokens at 1,000 tokens/s with the 1.25 margin: urgent 1.25 s before due.
    assert urgent_at(10.0, 4.0, 1000, 1000.0) == pytest.approx(10.0 + 4.0 - 1.25)
    assert urgent_at(10.0, 1.0, 1000, 1000.0) == pytest.approx(9.75)  # urgent already
    assert urgent_at(10.0, None, 1000, 1000.0) == NEVER  # no objective
    assert urgent_at(10.0, 4.0, 1000, None) == 10.0  # no speed measured yet: at once


def test_best_rate_is_the_fastest_of_the_recent_prompts():
    rate = BestRate(window=3)
    assert rate.tokens_per_s is None
    for tokens, seconds in ((1000, 2.0), (1200, 1.0), (0, 1.0), (600, 1.0), (900, 1.0)):
        rate.observe(tokens, seconds)
    assert rate.tokens_per_s == 1200.0  # 500, 1200, 600: the empty prompt is not a sample
    rate.observe(100, 1.0)  # 1200 leaves the window
    assert rate.tokens_per_s == 900.0


def test_the_word_carries_the_earliest_urgent_time_of_the_prompts_in_hand(base):
    clock, busy = Clock(), PrefillBusy(base)
    decode = StepYield(base, None, sleep=lambda s: None, clock=clock)
    assert decode.prefill_state()[:2] == (0, NEVER)
    late, soon = busy.enter(urgent_at=5.0), busy.enter(urgent_at=3.0)
    busy.enter()  # no objective
    assert decode.prefill_state()[:2] == (3, 3.0)
    clock.now = 2.9
    assert not decode.urgent()
    clock.now = 3.0
    assert decode.urgent()
    busy.leave(soon)
    assert decode.prefill_state() == (2, 5.0, 1) and not decode.urgent()
    busy.leave(late)
    busy.leave()
    busy.leave()  # none in hand: nothing
    assert decode.prefill_state()[:2] == (0, NEVER)
    busy.close()


def test_slack_mode_waits_whole_for_an_urgent_prompt(base):
    """Budget 20 ms: a prompt that is not urgent gets 20 ms; one that turns urgent during
    the wait (at 1.01) keeps decode waiting until it is done (at 1.5); an urgent prompt
    makes decode wait even with no budget at all."""
    clock, busy = Clock(), PrefillBusy(base)

    def sleep(s):
        clock.now += s
        if clock.now >= 1.5 - 1e-9 and token in busy._in_hand:
            busy.leave(token)

    decode = StepYield(base, None, sleep=sleep, clock=clock)
    token = busy.enter(urgent_at=100.0)
    clock.now = 1.0
    assert decode.pause(0.02) == pytest.approx(0.02)
    busy.leave(token)
    token = busy.enter(urgent_at=1.01)
    clock.now = 1.0
    assert decode.pause(0.02) == pytest.approx(0.5)
    token = busy.enter(urgent_at=0.0)
    clock.now = 1.0
    assert decode.pause(0.0) == pytest.approx(0.5)
    busy.close()
