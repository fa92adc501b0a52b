"""The interleaved compare's driver: turns, time shares, the policy rate, booting and the
fallback to one system at a time (servers and measurements faked)."""

import dataclasses

import pytest

from tests.unit.conftest import fake_compare_config


def test_interleaved_compare_measures_the_systems_that_booted(tmp_path, fake_pdserve,
                                                               monkeypatch):
    """vLLM's server exits before it is ready: its error is reported, pdserve is still
    measured, and the SLOs come from pdserve's unloaded run (the JSON says so)."""
    import sys

    from pdserve.bench import interleave
    from pdserve.bench.servers import ServerSpec

    def failing_vllm(cfg, port):
        return ServerSpec("vllm", [sys.executable, "-c", "import sys; sys.exit(3)"],
                          health_url=f"http://127.0.0.1:{port}/health", boot_timeout_s=30)

    monkeypatch.setattr(interleave, "vllm_spec", failing_vllm)
    target, _ = fake_pdserve
    result = interleave.run_interleaved(fake_compare_config(tmp_path, target,
                                                            ("vllm", "pdserve")))
    assert "vllm exited with 3 before it was ready" in result.systems["vllm"].error
    assert result.systems["vllm"].runs == []
    assert result.systems["pdserve"].error is None
    assert result.calibration.source == "pdserve"
    assert [name for name, _ in result.measured_in_order] == ["pdserve", "pdserve"]


def alternate_on_fake_clock(monkeypatch, attainment, search, shares_s: dict[str, float],
                            events: list | None = None):
    """`interleave.alternate` over one lane per system of ``shares_s`` (its share of the
    budget, seconds) with measurements faked: ``attainment(system, rate)`` for every class,
    each taking its estimate (40 / rate + 2 s) on a fake clock. Returns (result, lanes).
    With ``events``, each lane has a fake server to freeze and thaw, and ``events`` gets
    ("freeze", system), ("thaw", system) and ("measure", system, rate) in order."""
    import asyncio
    import os
    from types import SimpleNamespace

    from pdserve.bench import compare, interleave
    from pdserve.bench.search import RateSearch

    now = [1000.0]

    async def fake_measure(backend, bench, system, rate, num_requests):
        if events is not None:
            events.append(("measure", system, rate))
        now[0] += (num_requests - 1) / rate + 2.0
        att = attainment(system, rate)
        summary = SimpleNamespace(slo_attainment=att,
                                  by_class={"interactive": SimpleNamespace(slo_attainment=att)})
        return SimpleNamespace(load=SimpleNamespace(rate_rps=rate), summary=summary)

    monkeypatch.setattr(interleave, "measure", fake_measure)
    monkeypatch.setattr(interleave, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(compare, "time", SimpleNamespace(monotonic=lambda: now[0]))  # Budget
    out = compare.CompareResult()
    lanes = []
    for name, share_s in shares_s.items():
        out.systems[name] = compare.SystemResult(name)
        server = None if events is None else SimpleNamespace(
            pid=os.getpid(), freeze=lambda name=name: events.append(("freeze", name)),
            thaw=lambda settle_s, name=name: events.append(("thaw", name)))
        lanes.append(interleave.Lane(out.systems[name], None, None, server, RateSearch(search),
                                     compare.Budget(now[0] + share_s, 41, 1.0),
                                     freezable=server is not None))
    asyncio.run(interleave.alternate(lanes, out))
    return out, lanes


def test_interleaved_systems_take_turns_and_pdserve_follows_fifo_to_its_policy_rate(
        monkeypatch):
    """The turn order with measurements faked: each system's next rate in turn, rounds in
    the lanes' order and then in reverse; pdserve measures fifo's first interactive miss
    (2 req/s: pdserve measured it on its own search's turn just before) and its search
    reuses it."""
    from pdserve.bench.search import SearchConfig

    capacity = {"vllm": 3.0, "pdserve-fifo": 2.0, "pdserve": 3.0}  # meets below these
    search = SearchConfig(start_rps=1.0, floor_rps=0.5, factor=2.0, bisections=1,
                          max_up_steps=2)
    out, lanes = alternate_on_fake_clock(
        monkeypatch, lambda system, rate: 1.0 if rate < capacity[system] else 0.5, search,
        dict.fromkeys(("vllm", "pdserve-fifo", "pdserve"), 1e6))
    assert out.measured_in_order == [
        ("vllm", 1.0), ("pdserve-fifo", 1.0), ("pdserve", 1.0),
        ("pdserve", 2.0), ("pdserve-fifo", 2.0), ("vllm", 2.0),  # 2.0 is also fifo's miss
        ("vllm", 4.0), ("pdserve-fifo", 1.41), ("pdserve", 4.0),
        ("pdserve", 2.83), ("vllm", 2.83)]
    assert out.systems["pdserve"].search.goodput_rps == out.systems["vllm"].search.goodput_rps
    assert out.systems["pdserve-fifo"].search.bracket[1].rate_rps == 2.0
    assert all(lane.done for lane in lanes)


def test_systems_not_measuring_are_frozen_and_each_is_thawed_for_its_own_turn(monkeypatch):
    """`--idle-systems freeze`: before each measurement every other system is frozen (once)
    and the one measuring thawed; nothing is thawed twice or measured frozen. pdserve ends
    the first round and starts the second (reversed): two turns, one thaw."""
    from pdserve.bench.search import SearchConfig

    capacity = {"vllm": 1.5, "pdserve": 3.0}
    search = SearchConfig(start_rps=1.0, floor_rps=0.5, factor=2.0, bisections=0,
                          max_up_steps=1)
    events: list = []
    alternate_on_fake_clock(monkeypatch,
                            lambda system, rate: 1.0 if rate < capacity[system] else 0.5,
                            search, {"vllm": 1e6, "pdserve": 1e6}, events)
    assert events == [
        ("freeze", "pdserve"), ("measure", "vllm", 1.0),
        ("freeze", "vllm"), ("thaw", "pdserve"), ("measure", "pdserve", 1.0),
        ("measure", "pdserve", 2.0),
        ("freeze", "pdserve"), ("thaw", "vllm"), ("measure", "vllm", 2.0)]


def test_interleaved_budget_share_stops_a_search_and_others_time_is_not_charged(monkeypatch):
    """On a fake clock: each measurement takes its estimate. vLLM's 70 s share holds 1 and
    2 req/s (42 + 22 s) but not 4 (12 s more), although pdserve's turns took 64 s between."""
    from pdserve.bench.search import SearchConfig

    search = SearchConfig(start_rps=1.0, floor_rps=0.5, max_up_steps=3)
    out, _ = alternate_on_fake_clock(monkeypatch, lambda system, rate: 1.0, search,
                                     {"vllm": 70.0, "pdserve": 1e6})
    assert out.measured_in_order == [("vllm", 1.0), ("pdserve", 1.0), ("pdserve", 2.0),
                                     ("vllm", 2.0), ("pdserve", 4.0), ("pdserve", 8.0)]
    assert out.systems["vllm"].stopped_by_budget and not out.systems["pdserve"].stopped_by_budget
    assert out.systems["pdserve"].search.status.value == "above_ceiling"


def pdserve_missing_its_start(monkeypatch, vllm_share_s: float):
    """vLLM meets every rate up to 4 req/s; pdserve misses at its start (1 req/s) and meets
    at its floor (0.5); pdserve's share is 100 s. Returns (result, lanes)."""
    from pdserve.bench.search import SearchConfig

    capacity = {"vllm": 10.0, "pdserve": 0.75}
    search = SearchConfig(start_rps=1.0, floor_rps=0.5, factor=2.0, bisections=0,
                          max_up_steps=2)
    return alternate_on_fake_clock(
        monkeypatch, lambda system, rate: 1.0 if rate < capacity[system] else 0.5, search,
        {"vllm": vllm_share_s, "pdserve": 100.0})


def test_a_search_going_down_borrows_its_next_rate_from_the_others_shares(monkeypatch):
    """pdserve misses at 1 req/s; its floor, 0.5 req/s, costs 82 s on the fake clock and
    its 100 s share has 58 left: it takes the other 24 s from vLLM's unspent share (158 s
    left then) and brackets its goodput, where it used to stop "unbracketed". vLLM, going
    up, then has 134 s: enough for 2 and 4 req/s."""
    out, lanes = pdserve_missing_its_start(monkeypatch, vllm_share_s=200.0)
    assert out.measured_in_order == [("vllm", 1.0), ("pdserve", 1.0), ("pdserve", 0.5),
                                     ("vllm", 2.0), ("vllm", 4.0)]
    pd = out.systems["pdserve"]
    assert not pd.stopped_by_budget and pd.search.status.value == "found"
    assert [p.rate_rps for p in pd.search.bracket] == [0.5, 1.0]
    vllm_lane = next(lane for lane in lanes if lane.name == "vllm")
    assert vllm_lane.budget.left_s() == pytest.approx(200 - 42 - 22 - 12 - 24)


def test_a_search_going_down_stops_when_the_others_cannot_lend_enough(monkeypatch):
    """As above, but vLLM's 60 s share has 18 s left after its 1 req/s (and no room for
    its own 2 req/s, 22 s): pdserve's floor needs 24 s more than its share: both stop."""
    out, _ = pdserve_missing_its_start(monkeypatch, vllm_share_s=60.0)
    assert out.measured_in_order == [("vllm", 1.0), ("pdserve", 1.0)]
    assert out.systems["pdserve"].stopped_by_budget and out.systems["vllm"].stopped_by_budget
    assert out.systems["pdserve"].search.status.value == "unbracketed"


def fifo_missing_to_its_floor(monkeypatch, fifo_share_s: float):
    """fifo misses at 1 and at its floor 0.5 req/s; pdserve meets everything; pdserve's
    100 s share has 36 s left after its own 1.0 and 2.0 (42 + 22 s on the fake clock), not
    the 82 s that fifo's policy rate, 0.5, costs. Returns (result, lanes)."""
    from pdserve.bench.search import SearchConfig

    capacity = {"pdserve-fifo": 0.1, "pdserve": 10.0}
    search = SearchConfig(start_rps=1.0, floor_rps=0.5, max_up_steps=2)
    return alternate_on_fake_clock(
        monkeypatch, lambda system, rate: 1.0 if rate < capacity[system] else 0.5, search,
        {"pdserve-fifo": fifo_share_s, "pdserve": 100.0})


def test_interleaved_policy_rate_borrows_from_the_others_unspent_shares(monkeypatch):
    """fifo's search is over after its floor with time to spare: pdserve takes the 46 s its
    policy rate needs beyond its own share from fifo's, measures 0.5 req/s, and has nothing
    left for its search's 4 req/s."""
    out, lanes = fifo_missing_to_its_floor(monkeypatch, fifo_share_s=1e6)
    assert out.measured_in_order == [("pdserve-fifo", 1.0), ("pdserve", 1.0),
                                     ("pdserve", 2.0), ("pdserve-fifo", 0.5), ("pdserve", 0.5)]
    pd = out.systems["pdserve"]
    assert pd.skipped_rates == [] and pd.stopped_by_budget
    fifo_lane = next(lane for lane in lanes if lane.name == "pdserve-fifo")
    assert fifo_lane.budget.left_s() == pytest.approx(1e6 - 42 - 82 - 46)


def test_interleaved_policy_rate_out_of_time_is_skipped_and_the_search_goes_on(monkeypatch):
    """As above, but fifo's 130 s share has 6 s left after its two rates: nobody can lend
    pdserve the 46 s, so it skips that policy rate and still climbs from the 1.0 it
    measured as fifo's first miss."""
    out, _ = fifo_missing_to_its_floor(monkeypatch, fifo_share_s=130.0)
    assert out.measured_in_order == [("pdserve-fifo", 1.0), ("pdserve", 1.0),
                                     ("pdserve", 2.0), ("pdserve-fifo", 0.5), ("pdserve", 4.0)]
    pd = out.systems["pdserve"]
    assert pd.skipped_rates == [0.5] and not pd.stopped_by_budget
    assert pd.search.status.value == "above_ceiling" and pd.search.bound_rps == 4.0


def test_fits_in_memory_counts_engines_by_what_the_first_system_took():
    from pdserve.bench.interleave import MEMORY_HEADROOM, fits_in_memory

    assert MEMORY_HEADROOM == 1.25
    GiB = 2**30
    # vLLM (one engine) took 3 GiB: two pdserve systems, four engines, need 15 GiB.
    assert fits_in_memory("vllm", 3 * GiB, ["pdserve-fifo", "pdserve"], 15 * GiB) == (True, 15 * GiB)
    assert fits_in_memory("vllm", 3 * GiB, ["pdserve-fifo", "pdserve"], 14 * GiB) == (False, 15 * GiB)
    # pdserve (two engines) took 6 GiB: vLLM's one needs 3.75 GiB.
    assert fits_in_memory("pdserve", 6 * GiB, ["vllm"], 4 * GiB) == (True, round(3.75 * GiB))


def recording_server(events: list):
    """A ServerProcess stand-in that appends ("start" | "freeze" | "thaw" | "stop", name)."""
    import contextlib
    from types import SimpleNamespace

    @contextlib.contextmanager
    def fake_server(spec, log_path):
        events.append(("start", spec.name))
        yield SimpleNamespace(boot_s=0.0, pid=None,
                              freeze=lambda: events.append(("freeze", spec.name)),
                              thaw=lambda settle_s: events.append(("thaw", spec.name)))
        events.append(("stop", spec.name))

    return fake_server


def test_interleaved_compare_falls_back_to_one_system_at_a_time_when_the_rest_would_not_fit(
        tmp_path, fake_pdserve, monkeypatch):
    """The first system booted took 3 GiB of 10 for its two engines: the second needs 3.75
    GiB with headroom and 7 is available, so both boot. With 5 GiB taken, 5 left, the second
    would need 6.25: the first is stopped and both run one after the other, the JSON saying
    why."""
    from pdserve.bench import compare, compare_report, interleave

    target, _ = fake_pdserve
    port = int(target.rsplit(":", 1)[1])
    GiB = 2**30

    def measure_with(taken_gib: float):
        readings = iter([10 * GiB, round((10 - taken_gib) * GiB)] + [5 * GiB] * 20)
        events = []
        fake_server = recording_server(events)

        def fake_spec(cfg, port, system="pdserve"):
            from pdserve.bench.servers import ServerSpec
            return ServerSpec(system, ["true"], ready_pattern="ready")

        monkeypatch.setattr(interleave, "mem_available_bytes", lambda: next(readings))
        for module in (interleave, compare):
            monkeypatch.setattr(module, "ServerProcess", fake_server)
            monkeypatch.setattr(module, "free_port", lambda: port)
            monkeypatch.setattr(module, "pdserve_spec", fake_spec)
        cfg = dataclasses.replace(fake_compare_config(tmp_path, target, ("pdserve-fifo", "pdserve")),
                                  pdserve_target=None, fifo_engines="own")
        return interleave.run_interleaved(cfg), events, cfg

    result, events, _ = measure_with(3)
    assert result.mode == "interleaved" and result.mode_reason is None
    # pdserve frozen for fifo's unloaded run and first rate, then each thawed for its turn;
    # pdserve's two turns (end of round one, start of round two) come back to back.
    assert events == [("start", "pdserve-fifo"), ("start", "pdserve"),
                      ("freeze", "pdserve"), ("freeze", "pdserve-fifo"), ("thaw", "pdserve"),
                      ("freeze", "pdserve"), ("thaw", "pdserve-fifo"),
                      ("stop", "pdserve"), ("stop", "pdserve-fifo")]

    result, events, cfg = measure_with(5)
    assert result.mode == "sequential"
    assert result.mode_reason == ("pdserve would need about 6.2 GiB beside pdserve-fifo "
                                  "(5.0 GiB at boot), 5.0 GiB is available")
    assert events == [("start", "pdserve-fifo"), ("stop", "pdserve-fifo"),
                      ("start", "pdserve-fifo"), ("stop", "pdserve-fifo"),
                      ("start", "pdserve"), ("stop", "pdserve")]
    assert all(s.error is None and s.runs for s in result.systems.values())
    assert compare_report.compare_dict(cfg, result)["config"]["mode_reason"] == result.mode_reason


def test_a_shared_fifo_boots_after_pdserve_on_its_workers_and_never_freezes_them(
        tmp_path, fake_pdserve, monkeypatch):
    """`--fifo-engines shared`: pdserve boots first, fifo's gateway is started over the
    workers of pdserve's stack (its address), and the memory check counts no engines for
    it: pdserve took 5 GiB of 10, which left no room for a second stack (6.25 GiB with
    headroom, the test above) but is no obstacle here. pdserve is never frozen, as fifo's
    turns need its workers; fifo is frozen for pdserve's turns and thawed for its own. Its
    prompts get another content salt; the JSON says whose engines it ran on."""
    from pdserve.bench import compare_report, interleave, shared_fifo, systems
    from pdserve.bench.servers import ServerSpec

    target, _ = fake_pdserve
    port = int(target.rsplit(":", 1)[1])
    GiB = 2**30
    readings = iter([10 * GiB, 5 * GiB] + [5 * GiB] * 20)
    events, lent_from = [], []
    fake_server = recording_server(events)

    def fake_fifo_spec(cfg, port, pdserve_address):
        lent_from.append(pdserve_address)
        return ServerSpec(shared_fifo.SYSTEM, ["true"], ready_pattern="READY")

    monkeypatch.setattr(interleave, "mem_available_bytes", lambda: next(readings))
    monkeypatch.setattr(interleave, "ServerProcess", fake_server)
    monkeypatch.setattr(interleave, "free_port", lambda: port)
    monkeypatch.setattr(interleave, "pdserve_spec",
                        lambda cfg, port, system="pdserve": ServerSpec(system, ["true"],
                                                                       ready_pattern="ready"))
    monkeypatch.setattr(interleave, "shared_fifo_spec", fake_fifo_spec)
    cfg = dataclasses.replace(fake_compare_config(tmp_path, target, ("pdserve-fifo", "pdserve")),
                              pdserve_target=None)
    assert cfg.fifo_shares_engines()
    result = interleave.run_interleaved(cfg)

    assert result.mode == "interleaved" and result.mode_reason is None
    assert lent_from == [target]
    assert events == [("start", "pdserve"), ("start", "pdserve-fifo"),
                      ("freeze", "pdserve-fifo"), ("thaw", "pdserve-fifo"),
                      ("stop", "pdserve-fifo"), ("stop", "pdserve")]
    assert list(result.systems) == ["pdserve-fifo", "pdserve"]  # measured in the run order
    assert [name for name, _ in result.measured_in_order][:2] == ["pdserve-fifo", "pdserve"]
    doc = compare_report.compare_dict(cfg, result)
    assert doc["pdserve-fifo"]["engines_of"] == "pdserve" and doc["pdserve"]["engines_of"] is None
    fifo_bench = systems.bench_config_for(cfg, "pdserve-fifo", target)
    assert fifo_bench.content_salt == shared_fifo.CONTENT_SALT
    assert systems.bench_config_for(cfg, "pdserve", target).content_salt == 0
    own = dataclasses.replace(cfg, fifo_engines="own")
    assert not own.fifo_shares_engines()
    assert systems.bench_config_for(own, "pdserve-fifo", target).content_salt == 0
    assert not dataclasses.replace(cfg, sequential=True).fifo_shares_engines()


def test_a_content_salt_changes_the_prompts_token_ids_not_their_lengths():
    """fifo on pdserve's engines must not find pdserve's prompts of the same rate in the
    prefix cache: a salt gives other ids, the same lengths and classes."""
    from pdserve.bench.compare import rate_content_seed
    from pdserve.bench.presets import preset_workload
    from pdserve.bench.workload import build_workload, take

    workload = preset_workload("mixed")
    plain = take(build_workload(workload, 0, content_seed=rate_content_seed(0, 0.5)), 20)
    salted = take(build_workload(workload, 0, content_seed=rate_content_seed(0, 0.5, 1)), 20)
    assert [len(r.prompt_token_ids) for r in plain] == [len(r.prompt_token_ids) for r in salted]
    assert [(r.output_len, r.class_name) for r in plain] == [(r.output_len, r.class_name)
                                                              for r in salted]
    assert all(a.prompt_token_ids != b.prompt_token_ids for a, b in zip(plain, salted))
    assert rate_content_seed(0, 0.5, 0) == rate_content_seed(0, 0.5)


def test_shared_fifo_gateway_argv_and_the_up_gateway_it_finds():
    from pdserve.bench import shared_fifo, systems

    argv = shared_fifo.gateway_argv(7000, "/m", ["127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"],
                                    systems.PDSERVE_FLAGS["pdserve-fifo"])
    assert argv[1:] == ["-m", "pdserve.cli", "gateway", "--host", "127.0.0.1", "--port", "7000",
                        "--model", "/m", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2",
                        "--decode", "127.0.0.1:3", "--policy", "fifo",
                        "--local-prefill-max-tokens", "0"]
    assert shared_fifo.is_gateway_cmdline(["python", "-m", "pdserve.cli", "gateway", "--port", "1"])
    assert not shared_fifo.is_gateway_cmdline(["python", "-m", "pdserve.cli", "decode",
                                               "--gateway", "127.0.0.1:1"])
    assert not shared_fifo.is_gateway_cmdline(["python", "-m", "pdserve.cli"])
