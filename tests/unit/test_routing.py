"""The gateway's choice of KV transport between a prefill worker and the decode tier."""

import pytest

from gateway.workers import Worker, WorkerPool
from protos import worker_pb2


def worker(role: str, transports, host_id="boot/1", device="cpu", healthy=True) -> Worker:
    info = worker_pb2.WorkerInfo(role=role, transports=list(transports), host_id=host_id, kv_device=device)
    return Worker(role, f"{role}:1", channel=None, stub=None, info=info, healthy=healthy)


def test_auto_picks_shared_memory_on_one_host_and_tcp_across_hosts():
    prefill = worker("prefill", ["shm", "tcp", "nccl"])
    assert WorkerPool([prefill, worker("decode", ["shm", "tcp", "nccl"])]).kv_transport(prefill) == "shm"
    remote = worker("decode", ["shm", "tcp", "nccl"], host_id="other/1")
    assert WorkerPool([prefill, remote]).kv_transport(prefill) == "tcp"


def test_auto_on_gpus_picks_cuda_ipc_on_one_host_and_nccl_across_hosts():
    prefill = worker("prefill", ["cuda_ipc", "nccl", "tcp"], device="cuda")
    assert WorkerPool([prefill, worker("decode", ["cuda_ipc", "nccl"])]).kv_transport(prefill) == "cuda_ipc"
    assert WorkerPool([prefill, worker("decode", ["cuda_ipc", "nccl"], host_id="b/2")]).kv_transport(prefill) == "nccl"


def test_auto_falls_back_to_a_transport_every_decode_worker_reads():
    prefill = worker("prefill", ["shm", "nccl", "tcp"])
    pool = WorkerPool([prefill, worker("decode", ["tcp", "nccl"]), worker("decode", ["tcp"]),
                       worker("decode", ["shm"], healthy=False)])
    assert pool.kv_transport(prefill) == "tcp", "the unhealthy decode worker does not count"


def test_a_configured_transport_must_be_common():
    prefill = worker("prefill", ["shm", "tcp"])
    pool = WorkerPool([prefill, worker("decode", ["shm", "tcp"])])
    assert pool.kv_transport(prefill, "tcp") == "tcp"
    with pytest.raises(LookupError, match="'nccl' is not served"):
        pool.kv_transport(prefill, "nccl")
