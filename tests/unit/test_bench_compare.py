"""compare's pure parts (search plan, budget, extra rates, JSON, table), its CLI, and both
drivers against a fake pdserve."""

import argparse
import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest

from pdserve.bench import cli
from pdserve.bench.calibration import Calibration, Unloaded
from pdserve.bench.compare import (
    DEFAULT_MIN_DURATION_S,
    Budget,
    CompareConfig,
    CompareResult,
    SearchPlan,
    SystemResult,
    describe_routes,
    extra_rates,
    rate_content_seed,
    requests_at,
)
from pdserve.bench.compare_report import compare_dict, detail_dict, format_compare, policy_rate, saved_runs
from pdserve.bench.loadgen import LoadConfig
from pdserve.bench.metrics import SLO, SLOTable, summarize_run
from pdserve.bench.presets import preset_workload
from pdserve.bench.record import Chunk, RequestRecord
from pdserve.bench.runner import BenchConfig, RunResult
from pdserve.bench.search import RateSearch, SearchConfig
from tests.unit.conftest import fake_compare_config

SLOS = SLOTable(by_class={"interactive": SLO(1.0, 0.1), "offline": SLO(10.0, 0.1)})


def record(i: int, ttft_s: float, cls: str = "default") -> RequestRecord:
    send = float(i)
    chunks = [Chunk(send + ttft_s + 0.05 * k, 1) for k in range(3)]
    return RequestRecord(f"r{i}", cls, 0, 10, 3, send, chunks, done_s=chunks[-1].time_s,
                         output_tokens=3)


def run_at(rate: float, ttfts: list[float], cls: str = "default",
           offline: int = 0) -> RunResult:
    """Requests of `cls` with these TTFTs, plus `offline` offline ones that meet theirs."""
    records = [record(i, t, cls) for i, t in enumerate(ttfts)]
    records += [record(100 + i, 2.0, "offline") for i in range(offline)]
    slo = SLOS if offline else SLO(1.0, 0.1)
    return RunResult(LoadConfig(rate_rps=rate, num_requests=len(records)),
                     summarize_run(records, slo), records)


MET = [0.5] * 10
HALF = [0.5] * 5 + [3.0] * 5


def searched(name: str, runs: list[RunResult], cfg: SearchConfig) -> SystemResult:
    """A system whose search visited `runs` in order."""
    search = RateSearch(cfg)
    for run in runs:
        search.record(run.load.rate_rps, run.summary.slo_attainment)
    return SystemResult(name, runs=runs, search=search.outcome())


def calibration(classes=("default",)) -> Calibration:
    return Calibration("vllm", {c: Unloaded(8, 0.3, 0.04, 2.0) for c in classes})


def compare_cfg(tmp_path, workload="short") -> CompareConfig:
    bench = BenchConfig(concurrency=1, num_requests=10, workload=preset_workload(workload))
    return CompareConfig(bench=bench, model=tmp_path, workload_name=workload)


def test_vllm_below_the_floor_gives_a_labelled_lower_bound(tmp_path):
    search = SearchConfig(start_rps=0.5, floor_rps=0.25)
    result = CompareResult(calibration=calibration(), search=search, elapsed_s=100.0)
    result.systems["vllm"] = searched("vllm", [run_at(0.5, HALF), run_at(0.25, HALF)], search)
    result.systems["pdserve"] = searched(
        "pdserve", [run_at(0.5, MET), run_at(1.0, HALF), run_at(0.707, MET),
                    run_at(0.841, HALF)], search)
    doc = json.loads(json.dumps(compare_dict(compare_cfg(tmp_path), result)))
    assert doc["vllm"]["goodput"]["status"] == "below_floor"
    assert (doc["vllm"]["goodput"]["bound_kind"], doc["vllm"]["goodput"]["bound_rps"]) == \
        ("<", 0.25)
    pd = doc["pdserve"]["goodput"]
    assert pd["status"] == "found" and pd["rates_in_order"] == [0.5, 1.0, 0.707, 0.841]
    # 0.707 + (1 - 0.9) / (1 - 0.5) * (0.841 - 0.707)
    assert pd["goodput_rps"] == pytest.approx(0.707 + 0.2 * 0.134)
    r = doc["ratios"]
    assert r["goodput_rps"] is None and r["goodput_rps_upper_bound"] is None
    assert r["goodput_rps_lower_bound"] == pytest.approx((0.707 + 0.2 * 0.134) / 0.25)
    assert "vllm below_floor (< 0.25 req/s)" in r["goodput_note"]
    assert r["at_rate_rps"] == 0.5 and r["ttft_p50_s"] == pytest.approx(0.5 / 1.75)
    assert doc["slo"]["derived_from"] == "vllm"
    assert doc["slo"]["unloaded_p50"]["default"]["ttft_p50_s"] == 0.3
    assert doc["slo"]["by_class"]["default"]["ttft_s"] == pytest.approx(0.9)
    assert doc["config"]["search"]["floor_rps"] == 0.25
    assert doc["config"]["search"]["ceiling_rps"] == 16.0
    assert doc["config"]["workload_name"] == "short"
    table = format_compare(doc)
    assert "goodput ratio pdserve / vllm: >= 2.94 (bounds only: pdserve 0.734 req/s" in table
    assert "goodput: < 0.25 req/s (below_floor)" in table
    assert "SLOs: ttft and tpot from vllm's unloaded p50" in table


def test_both_found_gives_a_value(tmp_path):
    search = SearchConfig(start_rps=0.5, floor_rps=0.25, bisections=0)
    result = CompareResult(calibration=calibration(), search=search)
    result.systems["vllm"] = searched("vllm", [run_at(0.5, MET), run_at(1.0, HALF)], search)
    result.systems["pdserve"] = searched(
        "pdserve", [run_at(0.5, MET), run_at(1.0, MET), run_at(2.0, HALF)], search)
    doc = compare_dict(compare_cfg(tmp_path), result)
    assert doc["vllm"]["goodput"]["goodput_rps"] == pytest.approx(0.6)
    assert doc["ratios"]["goodput_rps"] == pytest.approx(1.2 / 0.6)
    assert doc["ratios"]["goodput_rps_lower_bound"] is None
    assert doc["ratios"]["at_rate_rps"] == 1.0  # the highest rate both measured
    assert "goodput ratio pdserve / vllm: 2" in format_compare(doc)


def test_failed_system_is_reported_not_raised(tmp_path):
    search = SearchConfig(start_rps=0.5, floor_rps=0.25)
    result = CompareResult(calibration=calibration(), search=search)
    result.systems["vllm"] = searched("vllm", [run_at(0.5, MET)], search)
    result.systems["pdserve"] = SystemResult("pdserve", error="exited with 1")
    doc = compare_dict(compare_cfg(tmp_path), result)
    assert doc["pdserve"]["error"] == "exited with 1" and doc["pdserve"]["goodput"] is None
    assert doc["ratios"]["goodput_rps"] is None and doc["ratios"]["at_rate_rps"] is None
    assert "failed: exited with 1" in format_compare(doc)


def test_mixed_policy_compares_interactive_at_fifos_first_failing_rate(tmp_path):
    search = SearchConfig(start_rps=0.2, floor_rps=0.1, bisections=0)
    fifo_runs = [run_at(0.2, MET, "interactive", offline=2),
                 run_at(0.4, HALF, "interactive", offline=2)]
    assert policy_rate(fifo_runs) == 0.4
    result = CompareResult(calibration=calibration(("interactive", "offline")), search=search)
    result.systems["vllm"] = searched("vllm", [run_at(0.2, HALF, "interactive", 2)], search)
    result.systems["pdserve-fifo"] = searched("pdserve-fifo", fifo_runs, search)
    assert extra_rates("pdserve", result) == [0.4]
    assert extra_rates("pdserve-fifo", result) == [] and extra_rates("vllm", result) == []
    slo_runs = [run_at(0.2, MET, "interactive", 2), run_at(0.4, [0.5] * 9 + [3.0],
                                                           "interactive", 2)]
    result.systems["pdserve"] = searched("pdserve", slo_runs, search)
    doc = json.loads(json.dumps(compare_dict(compare_cfg(tmp_path, "mixed"), result)))
    p = doc["policy"]
    assert p["rate_rps"] == 0.4
    assert (p["fifo_attainment"], p["slo_attainment"]) == (0.5, 0.9)
    assert p["slo_minus_fifo_points"] == pytest.approx(40.0)
    assert p["slo_ttft_p90_s"] == pytest.approx(0.75)  # 0.5 x 9, 3.0: p90 at rank 8.1
    assert p["slo_ttft_p90_over_unloaded_p50"] == pytest.approx(0.75 / 0.3)
    by_class = doc["pdserve-fifo"]["measurements"][1]["by_class"]
    assert by_class["interactive"]["slo_attainment"] == 0.5
    assert by_class["interactive"]["ttft_p90_s"] == pytest.approx(3.0)
    assert by_class["offline"]["num_requests"] == 2
    assert p["by_rate"] == [
        {"rate_rps": 0.2, "fifo_attainment": 1.0, "slo_attainment": 1.0, "slo_minus_fifo_points": 0.0},
        {"rate_rps": 0.4, "fifo_attainment": 0.5, "slo_attainment": 0.9,
         "slo_minus_fifo_points": pytest.approx(40.0)}]
    assert ("policy (interactive at 0.4 req/s): slo 90.0% vs fifo 50.0% (+40.0 points)\n"
            "  at 0.2 req/s: slo 100.0% vs fifo 100.0% (+0.0 points)\n"
            "  at 0.4 req/s: slo 90.0% vs fifo 50.0% (+40.0 points)") in format_compare(doc)
    detail = detail_dict(result)
    assert [len(x["records"]) for x in detail["pdserve-fifo"]] == [12, 12]
    # Read back from JSON (scripts/class_attainment.py): the records as they were, by rate.
    back = list(saved_runs(json.loads(json.dumps(detail))))
    assert [(name, rate) for name, rate, _ in back] == [(name, r.load.rate_rps) for name, s in result.systems.items()
                                                        for r in s.runs]
    assert [records for _, _, records in back] == [r.records for s in result.systems.values() for r in s.runs]


def test_plan_derives_start_from_unloaded_e2e_and_floor_one_step_below():
    c = Calibration("vllm", {"interactive": Unloaded(8, 0.3, 0.04, 2.0),
                             "offline": Unloaded(8, 4.0, 0.05, 8.0)})
    cfg = SearchPlan().search_config(c, {"interactive": 0.75, "offline": 0.25})
    assert (cfg.start_rps, cfg.floor_rps, cfg.factor) == (0.286, 0.143, 2.0)  # 1 / 3.5 s
    given = SearchPlan(start_rps=1.0, floor_rps=0.1).search_config(c, {"interactive": 1.0})
    assert (given.start_rps, given.floor_rps) == (1.0, 0.1)
    floor_above = SearchPlan(floor_rps=1.0).search_config(c, {"interactive": 1.0})
    assert (floor_above.start_rps, floor_above.floor_rps) == (1.0, 1.0)


def test_budget_estimates_a_rate_from_its_arrivals_and_drain():
    budget = Budget(time.monotonic() + 100.0, num_requests=41, unloaded_e2e_s=5.0)
    assert budget.cost_s(0.5) == pytest.approx(80.0 + 10.0)
    assert budget.fits(0.5) and not budget.fits(0.5, reserve_s=20.0)
    assert not budget.fits(0.4)  # 100 + 10 s


def test_with_the_loads_seed_a_rate_costs_its_schedules_last_arrival():
    """The schedule is seeded, the same for every system: its last arrival, not the mean.
    Long's 40 arrivals at 0.062 req/s on the default seed span 765 s, not 629 s."""
    from pdserve.bench.arrivals import arrival_offsets_s

    budget = Budget(time.monotonic() + 1000.0, num_requests=40, unloaded_e2e_s=5.0, seed=0)
    assert budget.cost_s(0.062) == pytest.approx(arrival_offsets_s(0.062, 1.0, 0, 40)[-1] + 10.0)
    assert budget.cost_s(0.062) == pytest.approx(775.4, abs=0.1)
    assert Budget(time.monotonic() + 1000.0, 40, 5.0).cost_s(0.062) == pytest.approx(39 / 0.062 + 10.0)
    bursty = Budget(time.monotonic() + 1000.0, 40, 5.0, burstiness=0.5, seed=0)
    assert bursty.cost_s(0.062) == pytest.approx(arrival_offsets_s(0.062, 0.5, 0, 40)[-1] + 10.0)


def test_a_rate_is_measured_for_at_least_its_minimum_duration():
    assert requests_at(40, 0.5, 60.0) == 40  # 40 requests span 80 s already
    assert requests_at(40, 5.16, 60.0) == 310  # 309.6 arrive in 60 s
    assert requests_at(40, 1.0, 60.0) == 60
    assert requests_at(40, 10.3, 0.0) == 40
    budget = Budget(time.monotonic() + 100.0, num_requests=40, unloaded_e2e_s=1.0,
                    min_duration_s=60.0)
    assert budget.requests(5.0) == 300
    assert budget.cost_s(5.0) == pytest.approx(299 / 5.0 + 2.0)
    assert budget.cost_s(0.5) == pytest.approx(39 / 0.5 + 2.0)


@pytest.mark.parametrize("driver", ["interleaved", "sequential"])
def test_both_drivers_measure_a_rate_with_the_requests_its_minimum_duration_asks(
        tmp_path, fake_pdserve, driver):
    from pdserve.bench.compare import run_sequential
    from pdserve.bench.interleave import run_interleaved

    target, received = fake_pdserve
    cfg = fake_compare_config(tmp_path, target)
    cfg = dataclasses.replace(cfg, min_duration_s=2.5, plan=dataclasses.replace(
        cfg.plan, start_rps=2.0, floor_rps=1.0, max_up_steps=0))
    result = (run_interleaved if driver == "interleaved" else run_sequential)(cfg)
    (run,) = result.systems["pdserve"].runs
    assert (run.load.rate_rps, run.load.num_requests, run.summary.num_requests) == (2.0, 5, 5)
    # warmup, unloaded, 2.0 req/s for 2.5 s (and interleaved, the unloaded run again)
    assert len(received) == 1 + 2 + 5 + (2 if driver == "interleaved" else 0)


def test_every_system_gets_the_same_prompts_at_a_rate():
    assert rate_content_seed(0, 0.25) == rate_content_seed(0, 0.25)
    assert len({rate_content_seed(0, r) for r in (0.25, 0.251, 0.5)}
               | {rate_content_seed(1, 0.25)}) == 4


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_run_carries_an_slo_per_class():
    """A mixed load judged by one SLO would hold offline prompts to the interactive
    objective (and pdserve's admission would refuse them on it)."""
    args = parse(["bench", "run", "--workload", "mixed", "--rate", "1", "--slo-tpot-s", "0.1",
                  "--class-slo", "interactive=0.4:0.04, offline=3:"])
    slo = cli.bench_config(args).slo
    assert slo == SLOTable(SLO(None, 0.1), {"interactive": SLO(0.4, 0.04), "offline": SLO(3.0, None)})
    assert slo.of("offline") == SLO(3.0, None) and slo.of("batch") == SLO(None, 0.1)
    assert cli.bench_config(parse(["bench", "run", "--rate", "1", "--slo-ttft-s", "2"])).slo == SLO(2.0, None)
    for bad in ("interactive", "interactive=0.4", "=1:1", "offline=x:1", "offline=0:1", ","):
        with pytest.raises(SystemExit):
            parse(["bench", "run", "--class-slo", bad])
    with pytest.raises(SystemExit):  # compare calibrates its per-class SLOs
        parse(["bench", "compare", "--class-slo", "interactive=0.4:0.04"])


def test_cli_compare_without_flags_is_the_short_preset(tmp_path):
    cfg = cli.compare_config(parse(["bench", "compare"]), tmp_path)
    assert cfg.workload_name == "short" and cfg.systems == ("vllm", "pdserve")
    assert cfg.bench.workload == preset_workload("short")
    assert cfg.bench.num_requests == 40 and cfg.bench.slo == SLO()
    assert cfg.plan == SearchPlan(budget_s=38 * 60.0)
    assert cfg.min_duration_s == DEFAULT_MIN_DURATION_S == 60.0


def test_each_compare_keeps_its_server_logs_in_a_directory_of_its_own(tmp_path):
    """bench-logs/<system>.log was overwritten by the next compare."""
    cfg = cli.compare_config(parse(["bench", "compare", "--workload", "long"]), tmp_path)
    assert cfg.log_dir.parent == Path("bench-logs") and cfg.log_dir.name.startswith("compare-long-")
    assert cli.run_log_dir(tmp_path, "mixed", now=0.0) == tmp_path / "compare-mixed-19700101T000000Z"
    first, second = (cli.run_log_dir(tmp_path, "short", now=t) for t in (0.0, 61.0))
    cli.link_latest(first)
    cli.link_latest(second)  # the link moves to the newer run; the older keeps its directory
    assert first.is_dir() and (tmp_path / "latest").resolve() == second.resolve()
    given = cli.compare_config(parse(["bench", "compare", "--log-dir", str(tmp_path / "x")]), tmp_path)
    assert given.log_dir == tmp_path / "x"


def test_cli_compare_mixed_runs_three_systems_fifo_before_slo(tmp_path):
    cfg = cli.compare_config(parse(["bench", "compare", "--workload", "mixed"]), tmp_path)
    assert cfg.run_order() == ("vllm", "pdserve-fifo", "pdserve")
    assert [c.name for c in cfg.bench.workload.classes] == ["interactive", "offline"]
    picked = cli.compare_config(parse(
        ["bench", "compare", "--workload", "long", "--systems", "pdserve,vllm",
         "--num-requests", "4", "--start-rate", "0.5", "--floor-rate", "0.2",
         "--bisections", "1", "--budget-min", "10", "--slo-ttft-s", "2"]), tmp_path)
    assert picked.run_order() == ("vllm", "pdserve")
    assert picked.plan == SearchPlan(0.5, 0.2, 2.0, 1, 5, 600.0, 8)
    assert picked.bench.slo == SLO(ttft_s=2.0)
    assert picked.bench.workload.input_len.high == 2048
    with pytest.raises(ValueError, match="systems"):
        cli.compare_config(parse(["bench", "compare", "--systems", "sglang"]), tmp_path)
    with pytest.raises(SystemExit):
        parse(["bench", "compare", "--rates", "1,2"])  # the search chooses the rates


def test_pdserve_whole_is_a_builtin_variant_run_after_pdserve_with_its_ratios(tmp_path):
    from pdserve.bench.systems import pdserve_argv

    cfg = cli.compare_config(parse(["bench", "compare", "--workload", "long", "--systems",
                                    "pdserve-whole,vllm,pdserve"]), tmp_path)
    assert cfg.run_order() == ("vllm", "pdserve", "pdserve-whole")
    argv = pdserve_argv(1, tmp_path, 4096, "pdserve-whole", cfg.variant("pdserve-whole"))
    assert argv[argv.index("--decode-yield") + 1] == "whole"
    assert "--decode-yield" not in pdserve_argv(1, tmp_path, 4096, "pdserve")
    assert "--policy" not in argv and "--decode-yield" not in pdserve_argv(1, tmp_path, 4096,
                                                                           "pdserve-fifo")
    search = SearchConfig(start_rps=0.5, floor_rps=0.25, bisections=0)
    result = CompareResult(calibration=calibration(), search=search)
    result.systems["vllm"] = searched("vllm", [run_at(0.5, MET), run_at(1.0, HALF)], search)
    result.systems["pdserve"] = searched("pdserve", [run_at(0.5, MET), run_at(1.0, HALF)],
                                         search)
    result.systems["pdserve-whole"] = searched(
        "pdserve-whole", [run_at(0.5, MET), run_at(1.0, MET), run_at(2.0, HALF)], search)
    doc = compare_dict(cfg, result)
    assert doc["ratios"]["goodput_rps"] == pytest.approx(1.0)
    assert doc["ratios_pdserve-whole"]["goodput_rps"] == pytest.approx(1.2 / 0.6)
    assert doc["variants"]["pdserve-whole"]["flags"] == ["--decode-yield", "whole"]
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    assert doc["config"]["commit"].startswith(head) and doc["variants"]["pdserve-whole"]["commit"] == \
        doc["config"]["commit"]
    table = format_compare(json.loads(json.dumps(doc)))
    assert "######## pdserve-whole ########" in table
    assert "goodput ratio pdserve / vllm: 1\n" in table
    assert "goodput ratio pdserve-whole / vllm: 2\n" in table


def test_variant_flags_and_source_run_after_the_others_from_their_checkout(tmp_path):
    from pdserve.bench.systems import pdserve_spec
    from pdserve.bench.variants import Variant

    other = tmp_path / "other"
    (other / "pdserve").mkdir(parents=True)
    (other / "pdserve" / "cli.py").write_text("")
    cfg = cli.compare_config(parse([
        "bench", "compare", "--workload", "long",
        "--variant", "fixed=--long-prefill-tokens 256 --no-long-prefill-adaptive",
        "--variant", f"base@{other}="]), tmp_path)
    assert cfg.run_order() == ("vllm", "pdserve", "pdserve-fixed", "pdserve-base")
    assert cfg.given_address("pdserve-fixed") is None
    fixed = pdserve_spec(cfg, 5000, "pdserve-fixed")
    assert fixed.argv[-3:] == ["--long-prefill-tokens", "256", "--no-long-prefill-adaptive"]
    assert fixed.cwd is None
    base = pdserve_spec(cfg, 5001, "pdserve-base")
    assert base.argv[base.argv.index("up") + 1:][-2:] == ["--metrics-port", "0"]  # no flags added
    assert base.cwd == other.resolve()
    assert base.env["PYTHONPATH"].split(":")[0] == str(other.resolve())
    plain = pdserve_spec(cfg, 5002, "pdserve")
    assert plain.env["PYTHONPATH"].split(":")[0] != str(other.resolve())
    for bad, why in [("fixed", "NAME"), ("Fixed=--x", "NAME"), ("fifo=--x", "NAME"),
                     ("same=", "pdserve itself"), (f"x@{tmp_path}=", "not a pdserve checkout"),
                     ("q=--x 'open", "cannot split")]:
        with pytest.raises(ValueError, match=why):
            Variant.parse(bad)
    with pytest.raises(ValueError, match="its own name"):
        cli.compare_config(parse(["bench", "compare", "--variant", "a=--x", "--variant", "a=--y"]),
                           tmp_path)
    with pytest.raises(ValueError, match="--variant"):
        cli.compare_config(parse(["bench", "compare", "--systems", "vllm,pdserve-nope"]), tmp_path)


def test_a_variant_is_paired_with_pdserve_request_by_request(tmp_path):
    from pdserve.bench.variants import Variant

    cfg = dataclasses.replace(compare_cfg(tmp_path), variants=(Variant("b", ("--x",)),))
    search = SearchConfig(start_rps=0.5, floor_rps=0.25, bisections=0)
    result = CompareResult(calibration=calibration(), search=search)
    # Requests r0-r9 at 0.5 req/s: pdserve misses r9, the variant r0; at 1.0 pdserve misses
    # r5-r9, the variant none; only the variant went on to 2.0.
    result.systems["pdserve"] = searched(
        "pdserve", [run_at(0.5, [0.5] * 9 + [3.0]), run_at(1.0, HALF)], search)
    result.systems["pdserve-b"] = searched(
        "pdserve-b", [run_at(0.5, [3.0] + [0.5] * 9), run_at(1.0, MET), run_at(2.0, HALF)], search)
    doc = compare_dict(cfg, result)
    ab = doc["ab_pdserve-b"]
    assert ab["against"] == "pdserve"
    assert ab["goodput"]["goodput_rps"] == pytest.approx(1.2 / 0.5)
    assert ab["rates"] == [
        {"rate_rps": 0.5, "num_paired": 10, "met_variant": 9, "met_base": 9, "only_variant": 1,
         "only_base": 1, "by_class": {"default": {"num_paired": 10, "met_variant": 9, "met_base": 9}}},
        {"rate_rps": 1.0, "num_paired": 10, "met_variant": 10, "met_base": 5, "only_variant": 5,
         "only_base": 0, "by_class": {"default": {"num_paired": 10, "met_variant": 10, "met_base": 5}}},
    ]
    assert "ratios_pdserve-b" not in doc  # no vLLM in this compare
    table = format_compare(json.loads(json.dumps(doc)))
    assert "pdserve-b against pdserve, same requests: goodput ratio 2.4\n" in table
    assert "  at 0.5 req/s: met 9 vs 9 of 10 (only pdserve-b 1, only pdserve 1)" in table
    assert "  at 1 req/s: met 10 vs 5 of 10 (only pdserve-b 5, only pdserve 0)" in table


@pytest.mark.parametrize("driver", ["interleaved", "sequential"])
def test_run_compare_against_a_fake_pdserve_calibrates_searches_and_sends_slos(
        tmp_path, fake_pdserve, driver):
    """The whole driver on the fake: the unloaded run sets the SLOs and start rate, the
    search climbs to its ceiling, every request carries its class priority and SLO."""
    from pdserve.bench.compare import run_sequential
    from pdserve.bench.interleave import run_interleaved
    from protos import generation_pb2

    target, received = fake_pdserve
    cfg = fake_compare_config(tmp_path, target)
    result = (run_interleaved if driver == "interleaved" else run_sequential)(cfg)
    assert result.mode == driver
    system = result.systems["pdserve"]
    assert system.error is None and result.calibration.source == "pdserve"
    start = result.search.start_rps
    e2e = result.calibration.unloaded["default"].e2e_p50_s
    assert start == pytest.approx(1 / e2e, rel=0.01) and result.search.floor_rps == \
        pytest.approx(start / 2, rel=0.01)
    assert [r.load.rate_rps for r in system.runs] == [start, pytest.approx(2 * start, rel=0.01)]
    assert system.search.status.value == "above_ceiling"
    # warmup 1, unloaded 2, then 3 per rate (and interleaved, the unloaded run again).
    assert len(received) == 1 + 2 + 3 + 3 + (2 if driver == "interleaved" else 0)
    # The unloaded prompts are the 4-8 token range's quartiles 1 and 3, not random draws.
    assert [len(r.token_ids) for r in received[1:3]] == [5, 7]
    assert result.calibration.slos().default == SLO(10.0, 1.0)
    measured = received[3:9]
    assert {(r.slo.ttft_ms, r.slo.tpot_ms) for r in measured} == {(10000, 1000)}
    # Given SLOs are known before the unloaded run, so its requests carry them too.
    assert {(r.slo.ttft_ms, r.slo.tpot_ms) for r in received[:3]} == {(10000, 1000)}
    assert {r.priority for r in measured} == {generation_pb2.PRIORITY_UNSPECIFIED}


@pytest.mark.parametrize("driver", ["interleaved", "sequential"])
def test_measured_requests_carry_the_slos_the_unloaded_run_set(tmp_path, fake_pdserve, driver):
    """No SLO given: the unloaded run sets them, after the backend was made (interleaved:
    at boot). Every measured request must carry them, or pdserve's admission has nothing
    to act on (seen: the interleaved driver sent none)."""
    from pdserve.bench.compare import run_sequential
    from pdserve.bench.interleave import run_interleaved

    target, received = fake_pdserve
    cfg = fake_compare_config(tmp_path, target)
    cfg = dataclasses.replace(cfg, bench=dataclasses.replace(cfg.bench, slo=SLO()),
                              plan=dataclasses.replace(cfg.plan, max_up_steps=0))
    result = (run_interleaved if driver == "interleaved" else run_sequential)(cfg)
    slo = result.calibration.slos().default
    assert slo.ttft_s is not None and slo.tpot_s is not None
    again = 2 if driver == "interleaved" else 0  # the unloaded run again, at the end
    measured = received[3:len(received) - again]  # after the warm-up and the two unloaded requests
    assert len(measured) == 3 * len(result.systems["pdserve"].runs) > 0
    assert {(r.slo.ttft_ms, r.slo.tpot_ms) for r in measured} == \
        {(max(1, round(slo.ttft_s * 1000)), max(1, round(slo.tpot_s * 1000)))}
    assert not any(r.HasField("slo") for r in received[:3])  # none known yet
    # The recheck's requests carry what the first unloaded run's did: none here.
    assert not any(r.HasField("slo") for r in received[len(received) - again:])


def test_the_measure_log_counts_where_pdserve_says_it_prefilled():
    def record(i: int, route: dict[str, str]) -> RequestRecord:
        return RequestRecord(f"r{i}", "default", 0, 10, 10, 0.0, route=route)

    records = [record(0, {"prefill": "local", "decode-worker": "a"}), record(1, {"prefill": "remote"}),
               record(2, {"prefill": "local"}), record(3, {}), record(4, {"prefill": "moved"})]
    assert describe_routes(records) == ", prefill local 2 / moved 1 / remote 1"
    assert describe_routes([record(0, {}), record(1, {})]) == ""  # vLLM says nothing


def test_saved_runs_leave_out_both_unloaded_runs():
    detail = {"unloaded": [], "unloaded_again": [], "vllm": [{"rate_rps": 1.0, "records": []}]}
    assert [(name, rate) for name, rate, _ in saved_runs(detail)] == [("vllm", 1.0)]
