"""PdConnector's bookkeeping, on fakes of the vLLM objects it reads (no engine)."""

import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvtransfer.connector import HANDLE_KEY, LOAD_KEY, SAVE_KEY, LoadSpec, PdConnector, PdConnectorMetadata, SaveSpec
from kvtransfer.layout import KVHandle, KVLayout
from kvtransfer.shm import ShmTransport, move_to_shared

BLOCK = 4
LAYOUT = KVLayout(num_layers=2, block_size=BLOCK, num_kv_heads=2, entry_size=8, dtype="bfloat16")


class FakeModelConfig:
    dtype = torch.bfloat16

    def get_num_layers(self, parallel_config):
        return LAYOUT.num_layers

    def get_num_kv_heads(self, parallel_config):
        return LAYOUT.num_kv_heads

    def get_head_size(self):
        return LAYOUT.entry_size // 2


def connector(role: KVConnectorRole, kv_role: str, transports=("shm",)) -> PdConnector:
    vllm_config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="PdConnector",
            kv_role=kv_role,
            kv_connector_extra_config={"producer_id": "p1", "transports": list(transports)},
        ),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        model_config=FakeModelConfig(),
        parallel_config=None,
        device_config=SimpleNamespace(device_type="cpu"),
    )
    return PdConnector(vllm_config, role, kv_cache_config=None)


def fake_request(request_id="r1", num_prompt_tokens=10, num_computed_tokens=0, params=None):
    return SimpleNamespace(
        request_id=request_id,
        num_prompt_tokens=num_prompt_tokens,
        num_computed_tokens=num_computed_tokens,
        kv_transfer_params=params,
    )


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def handle(num_tokens: int, location="/dev/shm/pdserve-kv-p1-x") -> KVHandle:
    return KVHandle("shm", location, num_tokens, LAYOUT, "p1")


# ---- consumer, scheduler half ----


def test_consumer_loads_every_prompt_token_but_the_last_beyond_local_hits():
    c = connector(KVConnectorRole.SCHEDULER, "kv_consumer")
    req = fake_request(num_prompt_tokens=11, params={LOAD_KEY: handle(10).to_dict()})
    assert c.get_num_new_matched_tokens(req, 0) == (10, False)
    assert c.get_num_new_matched_tokens(req, 4) == (6, False)  # one block hit locally
    # A handle as long as the prompt still leaves the last token to compute.
    whole = fake_request(num_prompt_tokens=10, params={LOAD_KEY: handle(10).to_dict()})
    assert c.get_num_new_matched_tokens(whole, 0) == (9, False)
    assert c.get_num_new_matched_tokens(fake_request(), 0) == (0, False)


def test_consumer_loads_into_the_blocks_after_the_local_hit_once():
    c = connector(KVConnectorRole.SCHEDULER, "kv_consumer")
    req = fake_request(num_prompt_tokens=11, params={LOAD_KEY: handle(10).to_dict()})
    c.update_state_after_alloc(req, blocks([7, 3, 9]), num_external_tokens=6)
    meta = c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 7}))
    assert meta.loads == [LoadSpec("r1", handle(10), block_ids=[3, 9], first_block=1, num_tokens=6)]
    assert meta.saves == []
    assert c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={})).loads == []
    assert c.request_finished(req, [7, 3, 9]) == (False, {"num_external_tokens": 6})


def test_consumer_without_external_tokens_records_nothing():
    c = connector(KVConnectorRole.SCHEDULER, "kv_consumer")
    req = fake_request(params={LOAD_KEY: handle(9).to_dict()})
    c.update_state_after_alloc(req, blocks([1, 2, 3]), num_external_tokens=0)
    assert c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 10})).loads == []
    assert c.request_finished(req, [1, 2, 3]) == (False, {"num_external_tokens": 0})


@pytest.fixture
def slack_env(monkeypatch):
    """Slack mode on a fresh core-share base with one prefill worker's word, and the
    step budget's clock under the test's hand: (word, now)."""
    from kvtransfer import coreshare, step_budget

    base = f"/dev/shm/pdserve-test-cores-{uuid.uuid4().hex}"
    monkeypatch.setenv(coreshare.ENV_FILE, base)
    monkeypatch.setenv(coreshare.ENV_YIELD_MS, coreshare.SLACK)
    now = [100.0]
    monkeypatch.setattr(step_budget, "time", SimpleNamespace(monotonic=lambda: now[0]))
    word = coreshare.PrefillBusy(base)
    yield word, now
    word.close()
    coreshare.remove_words(base)


def step_budget(c, requests, new=()):
    return c.build_connector_meta(SimpleNamespace(
        num_scheduled_tokens={r.request_id: 1 for r in requests}, scheduled_new_reqs=list(new))).yield_budget_s


def test_slack_mode_budgets_each_step_by_the_running_requests_tpot_objectives(slack_env, monkeypatch):
    """`--decode-yield slack`, scheduler half: while prefill has prompts in hand the
    metadata carries a share of the smallest lead of the scheduled requests, 0 while a
    prompt starts in the step or a request without an objective runs; 0 while prefill has
    none."""
    import kvtransfer.connector as module
    from kvtransfer import coreshare

    busy, now = slack_env
    busy.enter()
    c = connector(KVConnectorRole.SCHEDULER, "kv_consumer")
    r1 = fake_request("r1", params={module.TPOT_KEY: 0.1})
    r2 = fake_request("r2")  # no objective
    r1.num_output_tokens = r2.num_output_tokens = 0
    c.on_new_request(r1)
    c.on_new_request(r2)

    def step(at, running, new=()):
        now[0] = at
        return step_budget(c, running, new)

    budgets = [step(100.0, [r1, r2], new=["r1", "r2"])]  # their prompts run in this step
    r1.num_output_tokens = r2.num_output_tokens = 1
    budgets.append(step(100.05, [r1, r2]))  # r1's first token seen now: no lead yet
    r1.num_output_tokens = 11
    budgets.append(step(100.55, [r1, r2]))  # 10 more in 0.5 s against 1.0 s allowed, but r2 has none
    c.request_finished(r2, [])
    budgets.append(step(100.55, [r1]))  # r1 alone: lead 0.5 s
    busy.leave()
    budgets.append(step(100.55, [r1]))  # prefill has nothing in hand
    assert budgets == [0.0, 0.0, 0.0, pytest.approx(0.4), 0.0]

    monkeypatch.delenv(coreshare.ENV_YIELD_MS)
    plain = connector(KVConnectorRole.SCHEDULER, "kv_consumer")
    plain.on_new_request(r1)
    assert plain.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 1})).yield_budget_s == 0.0


def test_slack_mode_adds_the_tokens_to_come_at_the_pace_of_plain_steps(slack_env):
    """Ten plain decode steps of 50 ms while prefill is idle set the pace; when a prompt
    comes, r1 (objective 60 ms, 11 of 21 tokens made since 100.0) may pause for its lead
    (0.6 - 0.5 = 0.1 s) plus 10 tokens x 10 ms: 0.8 x 0.2 = 0.16 s."""
    import kvtransfer.connector as module

    busy, now = slack_env
    c = connector(KVConnectorRole.SCHEDULER, "kv_consumer")
    r1 = fake_request("r1", params={module.TPOT_KEY: 0.06})
    r1.max_tokens = 21
    c.on_new_request(r1)
    for k in range(10):
        now[0] = 100.0 + 0.05 * k
        r1.num_output_tokens = k + 1
        assert step_budget(c, [r1]) == 0.0  # prefill idle: no pause, a timed step
    assert c._budget.pace.step_s == pytest.approx(0.05)
    busy.enter()
    now[0] = 100.5
    r1.num_output_tokens = 11
    assert step_budget(c, [r1]) == pytest.approx(0.16)
    r1.max_tokens = None  # length unknown: the lead alone
    assert step_budget(c, [r1]) == pytest.approx(0.08)


# ---- producer, scheduler half ----


def test_producer_saves_once_when_the_last_prompt_chunk_is_scheduled():
    c = connector(KVConnectorRole.SCHEDULER, "kv_producer")
    c._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([5, 6, 8, 2],))
    req = fake_request(num_prompt_tokens=10, params={SAVE_KEY: "/dev/shm/pdserve-kv-p1-a"})
    c.on_new_request(req)
    assert c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 8})).saves == []
    req.num_computed_tokens = 8
    assert c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"other": 3})).saves == []
    meta = c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 2}))
    assert meta.saves == [SaveSpec("r1", "/dev/shm/pdserve-kv-p1-a", block_ids=[5, 6, 8], num_tokens=10, transport="shm")]
    assert c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 1})).saves == []
    delay, params = c.request_finished(req, [5, 6, 8, 2])
    assert delay is True, "shm publishes the engine's own blocks: vLLM must keep them"
    assert KVHandle.from_dict(params[HANDLE_KEY]) == KVHandle("shm", "/dev/shm/pdserve-kv-p1-a", 10, LAYOUT, "p1")


def test_a_producer_serving_several_transports_saves_through_the_one_asked_for():
    c = connector(KVConnectorRole.SCHEDULER, "kv_producer", transports=["shm", "tcp"])
    c._kv_cache_manager = SimpleNamespace(get_block_ids=lambda rid: ([3, 4],))
    req = fake_request(num_prompt_tokens=6, params={SAVE_KEY: {"transport": "tcp", "location": "tcp://h:1/k"}})
    c.on_new_request(req)
    meta = c.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r1": 6}))
    assert meta.saves == [SaveSpec("r1", "tcp://h:1/k", block_ids=[3, 4], num_tokens=6, transport="tcp")]
    delay, params = c.request_finished(req, [3, 4])
    assert delay is False, "tcp stages a copy; the engine's blocks are free at once"
    assert params[HANDLE_KEY]["transport"] == "tcp"


def test_producer_request_aborted_before_its_prefill_completes_has_no_handle():
    c = connector(KVConnectorRole.SCHEDULER, "kv_producer")
    req = fake_request(params={SAVE_KEY: "/dev/shm/pdserve-kv-p1-b"})
    c.on_new_request(req)
    assert c.request_finished(req, []) == (False, None)
    assert c._pending_saves == {}


# ---- worker halves, through the shm transport ----


def paged(seed: int | None, shared: bool = False) -> dict[str, torch.Tensor]:
    """Per-layer (num_blocks, H, N, C) views into one allocation, as vLLM lays them out;
    ``shared``: moved into shared memory the way a producer engine's cache is."""
    shape = (LAYOUT.num_layers, 16, LAYOUT.num_kv_heads, BLOCK, LAYOUT.entry_size)
    caches = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(torch.zeros(shape, dtype=torch.bfloat16).unbind(0))}
    if shared:
        move_to_shared(caches, f"test{uuid.uuid4().hex[:8]}")
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        for t in caches.values():
            t.copy_(torch.randn(t.shape, generator=gen).to(torch.bfloat16))
    return caches


@pytest.fixture
def location():
    path = ShmTransport.location_for(f"test{uuid.uuid4().hex[:8]}-{uuid.uuid4().hex}")
    yield path
    Path(path).unlink(missing_ok=True)


def test_blocks_saved_by_a_producer_land_in_the_consumers_blocks(location):
    producer = connector(KVConnectorRole.WORKER, "kv_producer")
    src = paged(seed=0, shared=True)
    producer.register_kv_caches(src)
    producer.bind_connector_metadata(PdConnectorMetadata(saves=[SaveSpec("r1", location, [5, 2, 11], 10)]))
    producer.wait_for_save()
    assert Path(location).exists(), "a lease names the blocks; they stay in the producer's cache"
    assert producer.get_finished({"r1"}) == (None, None), "held until the consumer has them"

    consumer = connector(KVConnectorRole.WORKER, "kv_consumer")
    dst = paged(seed=None)
    consumer.register_kv_caches(dst)
    # Blocks 1 and 2 of the handle (the first block was a local prefix-cache hit).
    load = LoadSpec("r1", KVHandle("shm", location, 10, LAYOUT, "p1"), block_ids=[7, 0], first_block=1, num_tokens=6)
    consumer.bind_connector_metadata(PdConnectorMetadata(loads=[load]))
    consumer.start_load_kv(forward_context=None)
    for name in src:
        assert torch.equal(dst[name][7], src[name][2])
        assert torch.equal(dst[name][0], src[name][11])
        untouched = [b for b in range(16) if b not in (7, 0)]
        assert not dst[name][untouched].any()
    assert consumer.get_block_ids_with_load_errors() == set()
    assert not Path(location).exists(), "the consumer ends the lease once it has the blocks"
    assert producer.get_finished(set()) == ({"r1"}, None), "the producer engine may free them now"
    assert producer.get_finished(set()) == (None, None)


def test_a_held_lease_is_freed_only_after_its_request_finished(location):
    producer = connector(KVConnectorRole.WORKER, "kv_producer")
    producer.register_kv_caches(paged(seed=0, shared=True))
    producer.bind_connector_metadata(PdConnectorMetadata(saves=[SaveSpec("r1", location, [1], 4)]))
    producer.wait_for_save()
    ShmTransport.release(location)  # aborted by the gateway before the engine finished it
    assert producer.get_finished(set()) == (None, None), "vLLM frees only finished requests"
    assert producer.get_finished({"r1"}) == ({"r1"}, None)


def test_a_producer_cache_outside_shared_memory_fails_the_save_not_the_engine(location):
    producer = connector(KVConnectorRole.WORKER, "kv_producer")
    producer.register_kv_caches(paged(seed=0, shared=False))
    producer.bind_connector_metadata(PdConnectorMetadata(saves=[SaveSpec("r1", location, [1], 4)]))
    producer.wait_for_save()
    assert not Path(location).exists()
    assert producer.get_finished({"r1"}) == ({"r1"}, None), "nothing published: free the blocks"


def test_a_missing_handle_is_a_failed_load_not_a_crash(location):
    consumer = connector(KVConnectorRole.WORKER, "kv_consumer")
    consumer.register_kv_caches(paged(seed=None))
    load = LoadSpec("r1", KVHandle("shm", location, 10, LAYOUT, "p1"), block_ids=[4, 6], first_block=0, num_tokens=8)
    consumer.bind_connector_metadata(PdConnectorMetadata(loads=[load]))
    consumer.start_load_kv(forward_context=None)
    assert consumer.get_block_ids_with_load_errors() == {4, 6}
    assert consumer.get_block_ids_with_load_errors() == set()


def test_a_handle_with_another_layout_is_a_failed_load(location):
    producer = connector(KVConnectorRole.WORKER, "kv_producer")
    producer.register_kv_caches(paged(seed=1, shared=True))
    producer.bind_connector_metadata(PdConnectorMetadata(saves=[SaveSpec("r1", location, [1], 4)]))
    producer.wait_for_save()
    consumer = connector(KVConnectorRole.WORKER, "kv_consumer")
    dst = paged(seed=None)
    consumer.register_kv_caches(dst)
    other = KVLayout(num_layers=2, block_size=BLOCK, num_kv_heads=2, entry_size=8, dtype="float16")
    load = LoadSpec("r1", KVHandle("shm", location, 4, other, "p1"), block_ids=[3], first_block=0, num_tokens=3)
    consumer.bind_connector_metadata(PdConnectorMetadata(loads=[load]))
    consumer.start_load_kv(forward_context=None)
    assert consumer.get_block_ids_with_load_errors() == {3}
    assert not any(t.any() for t in dst.values())


def test_a_failed_load_reports_no_external_tokens():
    from vllm.v1.outputs import KVConnectorOutput

    c = connector(KVConnectorRole.SCHEDULER, "kv_consumer")
    ok = fake_request("ok", num_prompt_tokens=9, params={LOAD_KEY: handle(8).to_dict()})
    bad = fake_request("bad", num_prompt_tokens=9, params={LOAD_KEY: handle(8).to_dict()})
    for req, ids in ((ok, [1, 2, 3]), (bad, [4, 5, 6])):
        n, _ = c.get_num_new_matched_tokens(req, 0)
        c.update_state_after_alloc(req, blocks(ids), n)
    c.update_connector_output(KVConnectorOutput(invalid_block_ids={5}))
    assert c.request_finished(ok, [1, 2, 3])[1] == {"num_external_tokens": 8}
    assert c.request_finished(bad, [4, 5, 6])[1] == {"num_external_tokens": 0}, "recomputed, not received"


def test_leases_of_a_producer_whose_cache_is_gone_are_swept_after_a_minute(tmp_path, monkeypatch):
    import os
    import time

    from kvtransfer import shm

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    live = tmp_path / f"{shm.CACHE_PREFIX}alive-{os.getpid()}"
    live.touch()
    keep = tmp_path / f"{shm.PREFIX}alive-k1"
    fresh = tmp_path / f"{shm.PREFIX}gone-k2"
    stale = tmp_path / f"{shm.PREFIX}gone-k3"
    for path in (keep, fresh, stale):
        path.touch()
    old = time.time() - 2 * shm.ORPHAN_LEASE_S
    os.utime(stale, (old, old))
    os.utime(keep, (old, old))
    assert shm.sweep_orphan_caches() == [str(stale)]
    assert keep.exists() and fresh.exists() and live.exists()
    # A killed producer: its cache and every lease naming it go at once.
    dead = tmp_path / f"{shm.CACHE_PREFIX}dead-999999999"
    dead.touch()
    (tmp_path / f"{shm.PREFIX}dead-k4").touch()
    assert shm.sweep_orphan_caches() == [str(dead)]
    assert not (tmp_path / f"{shm.PREFIX}dead-k4").exists()
