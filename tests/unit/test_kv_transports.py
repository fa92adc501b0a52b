"""The KV transports behind one interface: shm, tcp and nccl (gloo on CPU), cuda_ipc on GPU.

Producers and consumers run in this process (the producer's server threads serve the
consumer) except where a producer must die mid-transfer: that one is a child process.
Every socket binds 127.0.0.1 and every wait is bounded by a small ``kv_timeout_s``.
"""

from __future__ import annotations

import time
from pathlib import Path
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch
from prometheus_client import REGISTRY

import kvtransfer.tcp
from kvtransfer.bench import ProducerProcess, bitwise_equal, random_layers
from kvtransfer.layout import KVHandle, KVLayout, LayoutMismatchError
from kvtransfer.nccl import NcclTransport
from kvtransfer.shm import share
from kvtransfer.wire import Address
from kvtransfer.transport import KVTransferError, KVTransport, choose_transport, transport_class

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, entry_size=8, dtype="bfloat16")
NUM_BLOCKS = 16
TIMEOUT_S = 2.0
NETWORKED = ["tcp", "nccl"]


@dataclass
class Pair:
    """A producer with random KV and a consumer with zeroed KV, over one transport."""

    name: str
    producer: KVTransport
    consumer: KVTransport
    src: torch.Tensor  # (num_layers, NUM_BLOCKS, H, N, C)
    dst: torch.Tensor

    def publish(self, src_block_ids: list[int], num_tokens: int | None = None) -> KVHandle:
        cls = type(self.producer)
        key = f"test-{uuid.uuid4().hex}"
        location = cls.location_for(key, getattr(self.producer, "extra_config", {}))
        self.producer.send(location, list(self.src.unbind(0)), torch.tensor(src_block_ids))
        num_tokens = len(src_block_ids) * LAYOUT.block_size if num_tokens is None else num_tokens
        return KVHandle(self.name, location, num_tokens, LAYOUT, "test-producer")

    def fetch(self, handle: KVHandle, dst_block_ids: list[int], first_block: int = 0) -> None:
        self.consumer.recv(handle, list(self.dst.unbind(0)), torch.tensor(dst_block_ids),
                           first_block)


def make_transport(name: str, layout: KVLayout, serve: bool) -> KVTransport:
    config = {"kv_timeout_s": TIMEOUT_S}
    if serve and name != "shm":
        config |= {f"{name}_host": "127.0.0.1", f"{name}_port": 0}
    return transport_class(name)(layout, "test-producer" if serve else "test-consumer", config)


@pytest.fixture(params=["shm", *NETWORKED])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    yield from _pair(request.param)


@pytest.fixture(params=NETWORKED)
def net_pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    yield from _pair(request.param)


def _pair(name: str) -> Iterator[Pair]:
    producer = make_transport(name, LAYOUT, serve=True)
    consumer = make_transport(name, LAYOUT, serve=False)
    src = random_layers(LAYOUT, NUM_BLOCKS, seed=1)
    if name == "shm":  # an shm producer publishes blocks of a cache in shared memory
        src = share(src, "test-producer")
    try:
        yield Pair(name, producer, consumer, src, torch.zeros_like(src))
    finally:
        consumer.close()
        producer.close()
        if name == "shm":  # leases no test consumed
            for lease in Path("/dev/shm").glob("pdserve-kv-test-*"):
                lease.unlink(missing_ok=True)


def leases(name: str) -> float:
    return REGISTRY.get_sample_value("pdserve_kv_leases_outstanding", {"transport": name}) or 0.0


# ------------------------------ round trips ------------------------------


def test_round_trip_scattered_blocks(pair: Pair) -> None:
    handle = pair.publish([3, 7, 1, 9, 12])
    pair.fetch(handle, [10, 2, 5, 4, 0])
    assert bitwise_equal(pair.dst[:, [10, 2, 5, 4, 0]], pair.src[:, [3, 7, 1, 9, 12]])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (10, 2, 5, 4, 0)]
    assert not pair.dst[:, untouched].view(torch.int16).any()


def test_partial_range_from_nonzero_first_block(pair: Pair) -> None:
    # A consumer that already holds the first block (prefix cache) loads blocks 1..3 only.
    handle = pair.publish([3, 7, 1, 9, 12])
    pair.fetch(handle, [6, 7, 8], first_block=1)  # one destination run: received in place
    assert bitwise_equal(pair.dst[:, [6, 7, 8]], pair.src[:, [7, 1, 9]])
    assert not pair.dst[:, [0, 1, 2, 3, 4, 5, 9, 10]].view(torch.int16).any()


def test_range_beyond_handle_is_size_error(pair: Pair) -> None:
    handle = pair.publish([3, 7])
    with pytest.raises(KVTransferError) as e:
        pair.fetch(handle, [0, 1], first_block=1)
    assert e.value.reason == "size"


# ------------------------------ layouts ------------------------------


def test_handle_with_other_layout_is_refused_before_any_io(pair: Pair) -> None:
    handle = pair.publish([1, 2])
    other = KVLayout(3, 8, 2, 8, "bfloat16")
    forged = KVHandle(handle.transport, handle.location, handle.num_tokens, other, "x")
    with pytest.raises(LayoutMismatchError, match="block_size: 4 here vs 8 there"):
        pair.fetch(forged, [0, 1])
    assert not pair.dst.view(torch.int16).any()


@pytest.mark.parametrize("name", NETWORKED)
def test_producer_with_other_layout_is_refused_on_the_wire(name: str) -> None:
    # The handle claims the consumer's layout; the producer's header says otherwise.
    theirs = KVLayout(3, 4, 4, 8, "bfloat16")
    producer = make_transport(name, theirs, serve=True)
    consumer = make_transport(name, LAYOUT, serve=False)
    try:
        src = random_layers(theirs, NUM_BLOCKS, seed=2)
        location = type(producer).location_for("k", producer.extra_config)
        producer.send(location, list(src.unbind(0)), torch.tensor([1, 2]))
        dst = torch.zeros(LAYOUT.num_layers, NUM_BLOCKS, *LAYOUT.block_shape, dtype=torch.bfloat16)
        handle = KVHandle(name, location, 8, LAYOUT, "test-producer")
        with pytest.raises(KVTransferError, match="num_kv_heads: 4 here vs 2 there") as e:
            consumer.recv(handle, list(dst.unbind(0)), torch.tensor([0, 1]), 0)
        assert e.value.reason == "layout"
        assert not dst.view(torch.int16).any()
    finally:
        consumer.close()
        producer.close()


# ------------------------------ leases ------------------------------


def test_unknown_key_is_missing(pair: Pair) -> None:
    handle = pair.publish([1])
    cls = type(pair.producer)
    unknown = handle.location.replace(handle.location.rsplit("-", 1)[-1], "nope")
    with pytest.raises(KVTransferError) as e:
        pair.fetch(KVHandle(pair.name, unknown, 4, LAYOUT, "p"), [0])
    assert e.value.reason == "missing"
    cls.release(handle.location)


def test_released_location_is_missing_and_release_is_idempotent(pair: Pair) -> None:
    handle = pair.publish([1, 2])
    cls = type(pair.producer)
    cls.release(handle.location)
    cls.release(handle.location)
    with pytest.raises(KVTransferError) as e:
        pair.fetch(handle, [0, 1])
    assert e.value.reason == "missing"


def test_fetch_ends_the_lease(net_pair: Pair) -> None:
    before = leases(net_pair.name)
    handle = net_pair.publish([4, 5, 6])
    assert net_pair.producer.num_leases == 1
    assert leases(net_pair.name) == before + 1
    net_pair.fetch(handle, [1, 2, 3])
    assert net_pair.producer.num_leases == 0
    assert leases(net_pair.name) == before
    with pytest.raises(KVTransferError) as e:
        net_pair.fetch(handle, [1, 2, 3])
    assert e.value.reason == "missing"


def test_release_of_a_gone_producer_is_a_no_op(net_pair: Pair) -> None:
    handle = net_pair.publish([1])
    net_pair.producer.close()
    started = time.monotonic()
    type(net_pair.producer).release(handle.location)
    assert time.monotonic() - started < TIMEOUT_S
    assert leases(net_pair.name) == 0


def test_expired_lease_is_swept(net_pair: Pair) -> None:
    handle = net_pair.publish([1])
    swept = net_pair.producer._leases.sweep(now_s=time.monotonic() + 1e6)
    assert swept == [handle.location.rsplit("/", 1)[1]]
    with pytest.raises(KVTransferError) as e:
        net_pair.fetch(handle, [0])
    assert e.value.reason == "missing"


def test_unreachable_producer_is_peer_error(net_pair: Pair) -> None:
    handle = net_pair.publish([1])
    net_pair.producer.close()
    with pytest.raises(KVTransferError) as e:
        net_pair.fetch(handle, [0])
    assert e.value.reason == "peer"


@pytest.mark.parametrize("scheme", ["tcp", "nccl", "cuda_ipc"])
def test_location_round_trips_for_every_served_scheme(scheme: str) -> None:
    # "cuda_ipc" is no URL scheme (no "_" allowed): urllib alone reads it as a path, which
    # made every cuda_ipc handle unreadable (found on the first run on a GPU).
    for host in ["127.0.0.1", "decode-0.pdserve", "[::1]"]:
        location = f"{scheme}://{host}:4321/req-7"
        address = Address.parse(location, scheme)
        assert (address.host, address.port, address.key) == (host.strip("[]"), 4321, "req-7")
        assert str(address) == location
    for wrong in [f"tcp-x://h:1/k", f"{scheme}://h/k", f"{scheme}://h:1/", f"{scheme}://h:x/k",
                  f"{scheme}:/h:1/k"]:
        with pytest.raises(ValueError, match=f"not a {scheme} KV location"):
            Address.parse(wrong, scheme)


def test_location_needs_a_fixed_port() -> None:
    with pytest.raises(ValueError, match="tcp_port"):
        transport_class("tcp").location_for("k", {"tcp_port": 0})
    assert transport_class("tcp").location_for("k", {"tcp_host": "10.0.0.2", "tcp_port": 7000}) \
        == "tcp://10.0.0.2:7000/k"


# ------------------------------ a producer dying mid-transfer ------------------------------

BIG = KVLayout(num_layers=2, block_size=16, num_kv_heads=4, entry_size=128, dtype="bfloat16")
BIG_BLOCKS = 2048  # 64 MiB moved: far more than the socket buffers hold


@pytest.mark.parametrize("name", NETWORKED)
def test_producer_killed_mid_transfer(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    src = random_layers(BIG, BIG_BLOCKS, seed=3)
    producer = ProducerProcess(name, BIG, src, {f"{name}_host": "127.0.0.1", f"{name}_port": 0,
                                                "kv_timeout_s": TIMEOUT_S})
    consumer = make_transport(name, BIG, serve=False)
    try:
        location, _ = producer.send("doomed", list(range(BIG_BLOCKS)))
        _kill_on_first_data(monkeypatch, name, producer)
        dst = torch.zeros_like(src)
        handle = KVHandle(name, location, BIG_BLOCKS * BIG.block_size, BIG, "p")
        started = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            consumer.recv(handle, list(dst.unbind(0)), torch.arange(BIG_BLOCKS), 0)
        assert e.value.reason == "peer", e.value
        assert time.monotonic() - started < 3 * TIMEOUT_S
        assert not producer.process.is_alive()
    finally:
        consumer.close()
        producer.stop()


def _kill_on_first_data(monkeypatch: pytest.MonkeyPatch, name: str,
                        producer: ProducerProcess) -> None:
    if name == "tcp":
        original = kvtransfer.tcp.recv_into_all

        def recv_then_kill(sock, views):  # type: ignore[no-untyped-def]
            original(sock, views)
            if producer.process.is_alive():
                producer.kill()

        monkeypatch.setattr(kvtransfer.tcp, "recv_into_all", recv_then_kill)
    else:
        original_receive = NcclTransport._receive

        def kill_then_receive(self, *args):  # type: ignore[no-untyped-def]
            producer.kill()  # the producer has posted its sends: the header came first
            return original_receive(self, *args)

        monkeypatch.setattr(NcclTransport, "_receive", kill_then_receive)


# ------------------------------ selection ------------------------------


@pytest.mark.parametrize(
    ("same_host", "device", "expected"),
    [(True, "cpu", "shm"), (True, "cuda", "cuda_ipc"), (False, "cuda", "nccl"),
     (False, "cpu", "tcp")],
)
def test_choose_transport(same_host: bool, device: str, expected: str) -> None:
    assert choose_transport(same_host, device) == expected
    assert transport_class(expected).name == expected


def test_choose_transport_rejects_unknown_device() -> None:
    with pytest.raises(ValueError, match="'xpu'"):
        choose_transport(True, "xpu")


def test_unknown_transport_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="cuda_ipc, nccl, shm, tcp"):
        transport_class("rdma")


# ------------------------------ GPU ------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_round_trip_across_processes() -> None:
    layout = replace(LAYOUT, device="cuda")
    src = random_layers(layout, NUM_BLOCKS, seed=4, device="cuda")
    producer = ProducerProcess("cuda_ipc", layout, src, {"cuda_ipc_host": "127.0.0.1",
                                                         "cuda_ipc_port": 0,
                                                         "kv_timeout_s": 10.0})
    consumer = make_transport("cuda_ipc", layout, serve=False)
    try:
        location, _ = producer.send("gpu", [3, 7, 1, 9])
        dst = torch.zeros_like(src)
        consumer.recv(KVHandle("cuda_ipc", location, 16, layout, "p"), list(dst.unbind(0)),
                      torch.tensor([5, 6, 0], device="cuda"), 1)
        assert bitwise_equal(dst[:, [5, 6, 0]].cpu(), src[:, [7, 1, 9]].cpu())
    finally:
        consumer.close()
        producer.stop()
