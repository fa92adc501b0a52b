"""The compare's recheck (pdserve.bench.recheck): the end's p50s over the start's, the
objectives they would set, and every measured rate judged again by them."""

import dataclasses

import pytest

from pdserve.bench.calibration import Calibration, Unloaded
from pdserve.bench.compare_report import compare_dict, detail_dict, format_compare
from pdserve.bench.compare import CompareResult, SystemResult
from pdserve.bench.metrics import SweepPoint
from pdserve.bench.recheck import format_recheck, recheck_dict, rejudged_goodput
from pdserve.bench.search import SearchConfig
from tests.unit.conftest import fake_compare_config
from tests.unit.test_bench_compare import HALF, MET, run_at, searched


def test_the_recheck_gives_its_p50s_over_the_starts_and_judges_every_rate_by_its_slos(tmp_path):
    """The end's unloaded TTFT p50 half the start's halves the TTFT objective (0.9 s to
    0.45 s here): requests at 0.5 s then miss, and goodput judged again moves with it."""
    cfg = SearchConfig(start_rps=1.0, floor_rps=0.5, factor=2.0, bisections=0, max_up_steps=1)
    vllm = searched("vllm", [run_at(1.0, MET), run_at(2.0, HALF)], cfg)
    pdserve = searched("pdserve", [run_at(1.0, [0.4] * 10), run_at(2.0, [0.4] * 9 + [3.0])], cfg)
    result = CompareResult(systems={"vllm": vllm, "pdserve": pdserve},
                           calibration=Calibration("vllm", {"default": Unloaded(8, 0.3, 0.04, 2.0)}),
                           recheck=Calibration("vllm", {"default": Unloaded(8, 0.15, 0.05, 1.5)}))
    r = recheck_dict(result)
    assert r["over_start"]["default"] == pytest.approx({"ttft_p50": 0.5, "tpot_p50": 1.25, "e2e_p50": 0.75})
    assert r["by_class"]["default"] == pytest.approx({"ttft_s": 0.45, "tpot_s": 0.075})
    # vLLM's 0.5 s first tokens miss 0.45 s: below its lowest rate. pdserve's 0.4 s meet it.
    assert r["judged_by_these_slos"]["vllm"] == {
        "measurements": [{"rate_rps": 1.0, "slo_attainment": 0.0}, {"rate_rps": 2.0, "slo_attainment": 0.0}],
        "goodput": {"goodput_rps": None, "bound_kind": "<", "bound_rps": 1.0}}
    assert r["judged_by_these_slos"]["pdserve"]["goodput"] == {
        "goodput_rps": None, "bound_kind": ">=", "bound_rps": 2.0}
    assert r["goodput_ratio_by_these_slos"] is None  # no value on both sides
    assert rejudged_goodput([SweepPoint(1.0, 1.0), SweepPoint(2.0, 0.8)]) == {
        "goodput_rps": pytest.approx(1.5), "bound_kind": None, "bound_rps": None}
    assert rejudged_goodput([]) == {"goodput_rps": None, "bound_kind": None, "bound_rps": None}
    table = "\n".join(format_recheck(r))
    assert "  default: TTFT p50 0.50x, TPOT p50 1.25x the start's; its SLOs: TTFT 0.45 s, TPOT 75 ms" in table
    assert "  vllm judged by them: 0.0% at 1, 0.0% at 2; goodput < 1 req/s" in table


def test_the_recheck_judges_each_class_by_its_own_objective():
    """Mixed: the end's interactive TTFT p50 twice the start's doubles that class's
    objective alone; offline's stays, and each record is judged by its class's."""
    start = Calibration("vllm", {"interactive": Unloaded(8, 0.3, 0.04, 1.0),
                                 "offline": Unloaded(8, 3.0, 0.04, 6.0)})
    end = Calibration("vllm", {"interactive": Unloaded(8, 0.6, 0.04, 1.3),
                               "offline": Unloaded(8, 3.0, 0.04, 6.0)})
    # 10 interactive first tokens at 1.5 s (miss 0.9 s, meet 1.8 s) and 2 offline at 2.0 s.
    runs = [run_at(1.0, [1.5] * 10, cls="interactive", offline=2)]
    result = CompareResult(systems={"pdserve": SystemResult("pdserve", runs=runs)},
                           calibration=start, recheck=end)
    r = recheck_dict(result)
    assert r["over_start"]["interactive"]["ttft_p50"] == pytest.approx(2.0)
    assert r["over_start"]["offline"]["ttft_p50"] == pytest.approx(1.0)
    assert r["by_class"]["interactive"]["ttft_s"] == pytest.approx(1.8)
    assert r["by_class"]["offline"]["ttft_s"] == pytest.approx(9.0)
    assert r["judged_by_these_slos"]["pdserve"]["measurements"] == [{"rate_rps": 1.0, "slo_attainment": 1.0}]
    assert start.slos().of("interactive").met_by(runs[0].records[0]) is False


def test_the_interleaved_compare_runs_the_unloaded_run_again_at_the_end(tmp_path, fake_pdserve):
    """Once the searches are over, the unloaded run again on the same lengths with other
    token ids (none in the prefix cache); the JSON gives its p50s over the start's and the
    measured rates judged by the objectives it would set."""
    from pdserve.bench.interleave import run_interleaved

    target, received = fake_pdserve
    cfg = fake_compare_config(tmp_path, target)
    result = run_interleaved(cfg)
    assert result.recheck is not None and result.recheck_note is None
    first, again = received[1:3], received[-2:]
    assert [len(r.token_ids) for r in again] == [len(r.token_ids) for r in first] == [5, 7]
    assert [r.sampling.max_tokens for r in again] == [r.sampling.max_tokens for r in first]
    assert all(list(a.token_ids) != list(f.token_ids) for a, f in zip(again, first))
    assert [r.request_id for r in result.recheck_records] == ["recheck-default-0", "recheck-default-1"]
    doc = compare_dict(cfg, result)
    recheck = doc["slo"]["recheck"]
    end = result.recheck.unloaded["default"]
    assert recheck["over_start"]["default"]["ttft_p50"] == pytest.approx(
        end.ttft_p50_s / result.calibration.unloaded["default"].ttft_p50_s)
    judged = recheck["judged_by_these_slos"]["pdserve"]
    assert [m["rate_rps"] for m in judged["measurements"]] == sorted(
        r.load.rate_rps for r in result.systems["pdserve"].runs)
    assert doc["config"]["recheck"] is True
    assert [r["request_id"] for r in detail_dict(result)["unloaded_again"]] == \
        ["recheck-default-0", "recheck-default-1"]
    assert "unloaded run again at the end on pdserve:" in format_compare(doc)


@pytest.mark.parametrize("driver", ["interleaved", "sequential"])
def test_no_recheck_where_it_is_turned_off_or_the_first_system_is_stopped(tmp_path, fake_pdserve, driver):
    from pdserve.bench.compare import run_sequential
    from pdserve.bench.interleave import run_interleaved

    target, received = fake_pdserve
    cfg = fake_compare_config(tmp_path, target)
    if driver == "interleaved":
        cfg = dataclasses.replace(cfg, recheck=False)
    result = (run_interleaved if driver == "interleaved" else run_sequential)(cfg)
    assert result.recheck is None and not result.recheck_records
    assert len(received) == 1 + 2 + 3 * len(result.systems["pdserve"].runs)
    recheck = compare_dict(cfg, result)["slo"]["recheck"]
    if driver == "interleaved":
        assert recheck is None
    else:
        assert recheck == {"note": "not run: one system at a time, pdserve is stopped before the "
                                   "others are measured"}
        assert "unloaded run again at the end: not run" in format_compare(compare_dict(cfg, result))
