"""KV layouts on CPU tensors laid out exactly as each attention backend lays them out: the
layout read off the tensors, whole blocks copied in every layout (pure copy, shm, tcp, nccl
over gloo, the connector), and every pair of different layouts refusing each other."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtransfer.bench import ProducerProcess
from kvtransfer.connector import LOAD_KEY, PdConnector, PdConnectorMetadata, SaveSpec
from kvtransfer.layout import (
    KVHandle,
    KVLayout,
    LayoutMismatchError,
    UnknownLayoutError,
    expected_layout,
    layer_views,
    new_kv_caches,
)
from kvtransfer.shm import ShmTransport, copy_blocks, move_to_shared
from kvtransfer.transport import KVTransferError, transport_class
from pdserve.engine import layout_from_proto, layout_to_proto

# Every size distinct, so a mixed-up axis cannot go unnoticed.
LAYERS, BLOCKS, BLOCK, HEADS, HEAD_SIZE = 2, 16, 4, 2, 3


def vllm_views(name: str) -> list[torch.Tensor]:
    """vLLM 0.32's own per-layer [B, H, N, C] views under KVCacheLayout ``name``: what every
    attention backend (CPU_ATTN, FLASH_ATTN, FLASHINFER, TRITON_ATTN) is handed."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float32)
    layout = KVCacheLayout[name]
    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = spec.page_size_bytes * BLOCKS * LAYERS
    tensor = KVCacheTensor(size=size, layers=["l0", "l1"], layer_stride=strides[0],
                           block_stride=strides[1])
    return create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, BLOCKS, layout, tensor)


def classic(physical: tuple[int, ...], to_logical: tuple[int, ...]) -> list[torch.Tensor]:
    """One layer-major allocation in memory order, each layer viewed in its logical order."""
    return list(torch.zeros((LAYERS, *physical)).permute(0, *(1 + d for d in to_logical)).unbind(0))


B, N, H, D = BLOCKS, BLOCK, HEADS, HEAD_SIZE
# name -> (tensors as the backend allocates them, axes, memory order read off them)
CASES: dict[str, tuple[Callable[[], list[torch.Tensor]], str, str]] = {
    "cpu_attn/LBHNC": (lambda: vllm_views("LBHNC"), "BHNC", "BHNC"),
    "vllm-NHD/LBNHC": (lambda: vllm_views("LBNHC"), "BHNC", "BNHC"),
    "vllm/LHBNC": (lambda: vllm_views("LHBNC"), "BHNC", "HBNC"),
    "vllm/BLHNC": (lambda: vllm_views("BLHNC"), "BHNC", "BHNC"),  # layers interleaved
    "vllm/BHLNC": (lambda: vllm_views("BHLNC"), "BHNC", "BHNC"),
    "flash_attn": (lambda: classic((2, B, N, H, D), (0, 1, 2, 3, 4)), "KBNHD", "KBNHD"),
    "flash_attn-HND": (lambda: classic((2, B, H, N, D), (0, 1, 3, 2, 4)), "KBNHD", "KBHND"),
    "flashinfer": (lambda: classic((B, 2, N, H, D), (0, 1, 2, 3, 4)), "BKNHD", "BKNHD"),
    "flashinfer-HND": (lambda: classic((B, 2, H, N, D), (0, 1, 3, 2, 4)), "BKNHD", "BKHND"),
}


def layout_of(axes: str, order: str, device: str = "cpu") -> KVLayout:
    return KVLayout(LAYERS, BLOCK, HEADS, 2 * HEAD_SIZE, "float32", axes, order, device)


def canonical(layer: torch.Tensor, axes: str) -> torch.Tensor:
    """Any layout's layer as (B, N, H, K/V, D)."""
    if axes == "BHNC":
        return layer.unflatten(-1, (2, HEAD_SIZE)).permute(0, 2, 1, 3, 4)
    return layer.permute(1, 2, 3, 0, 4) if axes == "KBNHD" else layer.permute(0, 2, 3, 1, 4)


def fill(layers: list[torch.Tensor], axes: str) -> torch.Tensor:
    """Writes value(layer, block, token, head, kv, d) into every element; returns it as
    (L, B, N, H, K/V, D). Each value names its position, so any misplaced element shows."""
    grids = torch.meshgrid(*(torch.arange(n) for n in (LAYERS, B, N, H, 2, D)), indexing="ij")
    values = sum(g * w for g, w in zip(grids, (10**6, 10**4, 10**3, 100, 10, 1))) + 1
    values = values.float()
    for layer, value in zip(layers, values):
        canonical(layer, axes).copy_(value)
    return values


def moved(src_values: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> torch.Tensor:
    expected = torch.zeros_like(src_values)
    expected[:, dst_ids] = src_values[:, src_ids]
    return expected


def read(layers: list[torch.Tensor], axes: str) -> torch.Tensor:
    return torch.stack([canonical(layer, axes) for layer in layers])


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, str, str]:
    return request.param, CASES[request.param][1], CASES[request.param][2]


# ------------------------------ reading the layout ------------------------------


def test_the_layout_is_read_off_each_backends_tensors(case) -> None:
    name, axes, order = case
    assert KVLayout.from_kv_caches(CASES[name][0]()) == layout_of(axes, order)


def test_a_size_one_axis_names_its_layout_one_way() -> None:
    # One KV head: NHD and HND lay every byte alike, and say so.
    one = KVLayout(1, 4, 1, 6, "float32", "BHNC", "BNHC")
    assert one.memory_order == "BHNC"
    nhd = torch.zeros(3, 4, 1, 6).permute(0, 2, 1, 3)  # (B, H=1, N, C), tokens outer
    assert KVLayout.from_kv_caches([nhd]) == one


@pytest.mark.parametrize(("tensors", "message"), [
    ([torch.zeros(16, 4, 6)], "matches no known layout"),
    ([torch.zeros(2, 2, 4, 2, 3)], "both of its first two axes"),
    ([torch.zeros(3, 16, 4, 2, 3)], "neither of its first two axes"),
    ([torch.zeros(16, 2, 6, 4).transpose(2, 3)], "memory order 'BHCN'"),
    ([torch.zeros(1, 2, 4, 6).expand(16, 2, 4, 6)], "overlaps itself"),
    ([torch.zeros(16, 2, 4, 6), torch.zeros(16, 2, 4, 8)], "KV cache layers differ"),
    ([], "no KV cache layers"),
])
def test_an_unknown_layout_is_refused(tensors: list[torch.Tensor], message: str) -> None:
    with pytest.raises(UnknownLayoutError, match=message):
        KVLayout.from_kv_caches(tensors)


# ------------------------------ copying whole blocks ------------------------------


def test_pure_block_copy_moves_exactly_the_named_blocks(case) -> None:
    name, axes, order = case
    layout = layout_of(axes, order)
    src, dst = CASES[name][0](), CASES[name][0]()
    values = fill(src, axes)
    copy_blocks([layout.block_view(t) for t in src], [layout.block_view(t) for t in dst],
                [5, 2, 11], [7, 0, 9])
    assert torch.equal(read(dst, axes), moved(values, [5, 2, 11], [7, 0, 9]))
    assert read(dst, axes)[1, 7, 2, 1, 1, 0] == 1 * 10**6 + 5 * 10**4 + 2 * 10**3 + 100 + 10 + 1


@pytest.fixture
def producer_id() -> Iterator[str]:
    pid = f"test{uuid.uuid4().hex[:8]}"
    yield pid
    for lease in Path("/dev/shm").glob(f"pdserve-kv-{pid}*"):
        lease.unlink(missing_ok=True)


@pytest.mark.parametrize("transport", ["shm", "tcp", "nccl"])
def test_round_trip_with_a_prefix_hit_and_a_partial_last_block(case, transport,
                                                               producer_id) -> None:
    name, axes, order = case
    layout = layout_of(axes, order)
    src, dst = CASES[name][0](), CASES[name][0]()
    if transport == "shm":  # where a producer engine's cache lives (moved before it is written)
        move_to_shared(dict(enumerate(src)), producer_id)
    values = fill(src, axes)
    serve = {} if transport == "shm" else {f"{transport}_host": "127.0.0.1", f"{transport}_port": 0}
    cls = transport_class(transport)
    producer = cls(layout, producer_id, {"kv_timeout_s": 2.0, **serve})
    consumer = cls(layout, "consumer", {"kv_timeout_s": 2.0})
    try:
        location = cls.location_for(f"{producer_id}-k", getattr(producer, "extra_config", {}))
        # 14 tokens: three whole blocks and half of a fourth, all four published.
        producer.send(location, [layout.block_view(t) for t in src], torch.tensor([3, 12, 1, 9]))
        handle = KVHandle(transport, location, 14, layout, producer_id)
        # The consumer holds the first block already (prefix cache): blocks 1..3 only.
        consumer.recv(handle, [layout.block_view(t) for t in dst], torch.tensor([10, 2, 5]), 1)
    finally:
        consumer.close()
        producer.close()
    assert torch.equal(read(dst, axes), moved(values, [12, 1, 9], [10, 2, 5]))


@pytest.mark.parametrize("transport", ["tcp", "nccl"])
def test_a_producer_of_another_backend_is_refused_on_the_wire(transport) -> None:
    theirs, ours = layout_of("KBNHD", "KBHND"), layout_of("BKNHD", "BKHND")
    config = {"kv_timeout_s": 2.0}
    producer = transport_class(transport)(theirs, "p", {**config, f"{transport}_host": "127.0.0.1",
                                                        f"{transport}_port": 0})
    consumer = transport_class(transport)(ours, "c", config)
    try:
        src = CASES["flash_attn-HND"][0]()
        fill(src, "KBNHD")
        location = type(producer).location_for("k", producer.extra_config)
        producer.send(location, [theirs.block_view(t) for t in src], torch.tensor([1, 2]))
        dst = CASES["flashinfer-HND"][0]()
        with pytest.raises(KVTransferError, match="axes: KBNHD here vs BKNHD there") as e:
            # The handle claims our layout; the producer checks the one we send.
            consumer.recv(KVHandle(transport, location, 8, ours, "p"),
                          [ours.block_view(t) for t in dst], torch.tensor([0, 1]), 0)
        assert e.value.reason == "layout"
        assert not any(t.any() for t in dst)
    finally:
        consumer.close()
        producer.close()


# ------------------------------ every pair refuses ------------------------------

LAYOUTS = sorted({(axes, order) for _, axes, order in CASES.values()})
PAIRS = [*itertools.combinations(LAYOUTS, 2), (("BHNC", "BHNC"), ("BHNC", "BHNC"))]


@pytest.mark.parametrize(("a", "b"), PAIRS, ids=lambda p: "/".join(p))
def test_every_pair_of_layouts_refuses_each_other_naming_the_field(a, b) -> None:
    here, there = layout_of(*a), layout_of(*b, device="cuda" if a == b else "cpu")
    field, mine, theirs = (
        ("device", "cpu", "cuda") if a == b
        else ("axes", a[0], b[0]) if a[0] != b[0]
        else ("memory_order", a[1], b[1])
    )
    with pytest.raises(LayoutMismatchError, match=f"{field}: {mine} here vs {theirs} there"):
        here.check_compatible(there)
    with pytest.raises(LayoutMismatchError, match=f"{field}: {theirs} here vs {mine} there"):
        there.check_compatible(here)
    # The handshake (WorkerInfo, KvHandle) carries every field and compares them all.
    assert layout_from_proto(layout_to_proto(there)) == there
    assert layout_to_proto(here) != layout_to_proto(there)


def test_a_layout_with_unset_fields_from_an_older_peer_is_refused() -> None:
    msg = layout_to_proto(layout_of("BHNC", "BHNC"))
    msg.ClearField("axes")
    with pytest.raises(UnknownLayoutError, match="axes '' is not a known KV layout"):
        layout_from_proto(msg)


# ------------------------------ the connector ------------------------------


class FakeModelConfig:
    dtype = torch.float32

    def get_num_layers(self, parallel_config):
        return LAYERS

    def get_num_kv_heads(self, parallel_config):
        return HEADS

    def get_head_size(self):
        return HEAD_SIZE


def connector(role: KVConnectorRole, kv_role: str, producer_id: str = "p1",
              transports=("shm",), device: str = "cpu") -> PdConnector:
    vllm_config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdConnector", kv_role=kv_role,
            kv_connector_extra_config={"producer_id": producer_id, "transports": list(transports)},
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        model_config=FakeModelConfig(),
        parallel_config=None,
        device_config=SimpleNamespace(device_type=device),
    )
    return PdConnector(vllm_config, role, kv_cache_config=None)


@pytest.mark.parametrize(("vllm_layout", "env"), [
    ("LBHNC", None), ("BLHNC", "BLHNC"), ("LBNHC", "NHD"), ("BLNHC", "BLNHC"),
])
def test_connector_round_trip_in_the_layout_vllm_resolves(vllm_layout, env, producer_id,
                                                          monkeypatch) -> None:
    if env is not None:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", env)
    src, dst = vllm_views(vllm_layout), vllm_views(vllm_layout)
    move_to_shared(dict(enumerate(src)), producer_id)
    values = fill(src, "BHNC")
    producer = connector(KVConnectorRole.WORKER, "kv_producer", producer_id)
    producer.register_kv_caches(dict(enumerate(src)))
    location = ShmTransport.location_for(f"{producer_id}-k")
    save = SaveSpec("r1", location, [3, 12, 1, 9], num_tokens=14)
    producer.bind_connector_metadata(PdConnectorMetadata(saves=[save]))
    producer.wait_for_save()
    handle = KVHandle("shm", location, 14, expected_layout(producer._vllm_config), producer_id)

    # A 15-token prompt whose first block is a local prefix-cache hit: the scheduler asks
    # for tokens 4..13 (the last prompt token is computed here), in blocks 1..3.
    scheduler = connector(KVConnectorRole.SCHEDULER, "kv_consumer")
    request = SimpleNamespace(request_id="r1", num_prompt_tokens=15, num_computed_tokens=4,
                              kv_transfer_params={LOAD_KEY: handle.to_dict()})
    assert scheduler.get_num_new_matched_tokens(request, 4) == (10, False)
    allocated = SimpleNamespace(get_block_ids=lambda: ([6, 10, 2, 5],))
    scheduler.update_state_after_alloc(request, allocated, 10)
    meta = scheduler.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 11}))
    consumer = connector(KVConnectorRole.WORKER, "kv_consumer")
    consumer.register_kv_caches(dict(enumerate(dst)))
    consumer.bind_connector_metadata(meta)
    consumer.start_load_kv(forward_context=None)
    assert consumer.get_block_ids_with_load_errors() == set()
    assert torch.equal(read(dst, "BHNC"), moved(values, [12, 1, 9], [10, 2, 5]))


@pytest.mark.parametrize("name", ["flash_attn", "flashinfer-HND", "vllm-NHD/LBNHC"])
def test_connector_refuses_at_register_a_layout_it_did_not_announce(name) -> None:
    worker = connector(KVConnectorRole.WORKER, "kv_consumer")
    axes, order = CASES[name][1], CASES[name][2]
    field = (f"axes: {axes} allocated vs BHNC" if axes != "BHNC"
             else f"memory_order: {order} allocated")
    with pytest.raises(ValueError, match=f"not laid out as this worker announced .*{field}"):
        worker.register_kv_caches(dict(enumerate(CASES[name][0]())))


def test_connector_refuses_an_unknown_layout_at_register() -> None:
    worker = connector(KVConnectorRole.WORKER, "kv_consumer")
    with pytest.raises(UnknownLayoutError, match="matches no known layout"):
        worker.register_kv_caches({"l0": torch.zeros(16, 4, 6), "l1": torch.zeros(16, 4, 6)})


def test_connector_refuses_shm_for_a_gpu_cache_at_start() -> None:
    with pytest.raises(ValueError, match="the shm KV transport moves cpu KV caches; this engine "
                                         "keeps its KV on cuda"):
        connector(KVConnectorRole.WORKER, "kv_producer", transports=("shm", "nccl"), device="cuda")
    assert connector(KVConnectorRole.SCHEDULER, "kv_producer", transports=("tcp", "nccl"),
                     device="cuda")._layout.device == "cuda"


def test_connector_asks_vllm_for_the_layout_it_announces() -> None:
    from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_connector_cache_layout

    config = SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="PdConnector", kv_connector_module_path="kvtransfer.connector",
        kv_role="kv_producer"))
    assert get_kv_connector_cache_layout(config) == "LBHNC"
    assert expected_layout(connector(KVConnectorRole.SCHEDULER, "kv_producer")._vllm_config) \
        == layout_of("BHNC", "BHNC")


# ------------------------------ GPU ------------------------------


# One GPU: NCCL refuses two ranks on one device, so nccl needs two; cuda_ipc needs two
# processes (a process cannot open its own IPC handle): the producer runs in a child.


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["cuda_ipc", "nccl"])
@pytest.mark.parametrize("name",
                         ["cpu_attn/LBHNC", "vllm-NHD/LBNHC", "flash_attn-HND", "flashinfer"])
def test_cuda_round_trip_in_a_gpu_layout(name, transport) -> None:
    needed = 2 if transport == "nccl" else 1
    if torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} CUDA device(s)")
    axes, order = CASES[name][1], CASES[name][2]
    layout = layout_of(axes, order, device="cuda")
    sizes = layout.axis_sizes(BLOCKS)
    physical = torch.zeros((LAYERS, *(sizes[a] for a in order)), device=f"cuda:{needed - 1}")
    values = fill(layer_views(layout, physical), axes)
    producer = ProducerProcess(transport, layout, physical, {
        f"{transport}_host": "127.0.0.1", f"{transport}_port": 0, "kv_timeout_s": 20.0})
    consumer = transport_class(transport)(layout, "c", {"kv_timeout_s": 20.0})
    try:
        location, _ = producer.send("k", [3, 12, 1, 9])
        dst = new_kv_caches(layout, BLOCKS, "cuda:0")
        consumer.recv(KVHandle(transport, location, 14, layout, "p"),
                      [layout.block_view(t) for t in dst], torch.tensor([10, 2, 5]), 1)
    finally:
        consumer.close()
        producer.stop()
    assert torch.equal(read(dst, axes).cpu(), moved(values, [12, 1, 9], [10, 2, 5]))
