"""kvtransfer.coreshare: the prefill workers' count of prompts in hand, and the decode
engine's yield that reads it (in one process here; the word is a real /dev/shm file)."""

from __future__ import annotations

import os
import uuid

import pytest

from kvtransfer.coreshare import ENV_FILE, ENV_YIELD_MS, PrefillBusy, StepYield


@pytest.fixture
def word():
    path = f"/dev/shm/pdserve-test-cores-{uuid.uuid4().hex}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def test_decode_yields_only_while_prefill_has_prompts_in_hand(word):
    slept = []
    decode = StepYield(word, 0.015, sleep=slept.append)
    assert decode.pause() is False  # no prefill worker yet: no word, nothing in hand
    one, two = PrefillBusy(word), PrefillBusy(word)  # two prefill workers on these cores
    assert decode.pause() is False
    one.enter()
    two.enter()
    one.enter()
    assert decode.prefill_busy() == 3
    assert decode.pause() is True
    one.leave()
    one.leave()
    assert decode.prefill_busy() == 1 and decode.pause() is True
    two.leave()
    assert decode.prefill_busy() == 0 and decode.pause() is False
    assert slept == [0.015, 0.015]
    one.close()
    two.close()


def test_the_count_never_goes_below_zero(word):
    busy = PrefillBusy(word)
    busy.leave()
    busy.enter()
    assert StepYield(word, 0.01).prefill_busy() == 1
    busy.close()


def test_from_env_needs_both_the_word_and_a_positive_yield(word, monkeypatch):
    monkeypatch.delenv(ENV_FILE, raising=False)
    monkeypatch.setenv(ENV_YIELD_MS, "15")
    assert StepYield.from_env() is None and PrefillBusy.from_env() is None
    monkeypatch.setenv(ENV_FILE, word)
    assert StepYield.from_env().yield_s == pytest.approx(0.015)
    monkeypatch.setenv(ENV_YIELD_MS, "0")
    assert StepYield.from_env() is None
    busy = PrefillBusy.from_env()
    assert busy is not None and os.path.getsize(word) == 8
    busy.close()
