"""Shared by the tests of kvtransfer.coreshare and kvtransfer.prefill_threads: a settable
clock, and a fresh base path for shared-memory words that is cleaned up after each test."""

import glob
import uuid

import pytest

from kvtransfer.coreshare import remove_words


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def base():
    path = f"/dev/shm/pdserve-test-cores-{uuid.uuid4().hex}"
    yield path
    remove_words(path)
    assert not glob.glob(path + "*")
