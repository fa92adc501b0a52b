"""pdserve.gpus: GPU assignment of `pdserve up`'s workers (pure: GPU lists given)."""

from __future__ import annotations

import pytest

from pdserve import gpus
from pdserve.gpus import Placement, assign


def test_no_gpu_is_cpu():
    assert assign([], 1, 1) is None


def test_one_gpu_per_worker_when_there_are_enough():
    assert assign(["0", "1", "2"], 1, 2) == ([Placement("0", 0.9)], [Placement("1", 0.9), Placement("2", 0.9)])


def test_tiers_split_the_gpus_and_share_within_a_tier():
    prefill, decode = assign(["0", "1"], 2, 3)
    assert prefill == [Placement("0", 0.45)] * 2
    assert decode == [Placement("1", 0.3)] * 3


def test_one_gpu_is_shared_by_both_tiers_with_a_memory_split():
    assert assign(["0"], 1, 1) == ([Placement("0", 0.45)], [Placement("0", 0.45)])


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert gpus.visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpus.visible_gpus() == []
    assert gpus.default_kv_transports() == ("shm", "tcp", "nccl")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpus.default_kv_transports() == ("cuda_ipc", "tcp", "nccl")


@pytest.mark.parametrize("n_gpus, n_prefill, n_decode", [(4, 2, 2), (8, 1, 3), (3, 2, 2)])
def test_every_worker_gets_a_visible_gpu(n_gpus, n_prefill, n_decode):
    ids = [str(i) for i in range(n_gpus)]
    prefill, decode = assign(ids, n_prefill, n_decode)
    assert len(prefill) == n_prefill and len(decode) == n_decode
    assert all(p.cuda_visible_devices in ids and 0 < p.gpu_memory_utilization <= 0.9 for p in prefill + decode)
    if n_gpus >= 2:
        assert not {p.cuda_visible_devices for p in prefill} & {p.cuda_visible_devices for p in decode}
