"""SLOs from synthetic unloaded records: medians, factors, classes, given overrides."""

import pytest

from pdserve.bench.calibration import CalibrationError, calibrate, unloaded
from pdserve.bench.metrics import SLO, SLOTable
from pdserve.bench.record import Chunk, RequestRecord


def record(i: int, ttft_s: float, tpot_s: float, tokens: int = 5, cls: str = "default",
           error: str | None = None) -> RequestRecord:
    send = 100.0 * i
    chunks = [Chunk(send + ttft_s + k * tpot_s, 1) for k in range(tokens)]
    return RequestRecord(f"r{i}", cls, 0, 10, tokens, send, chunks, done_s=chunks[-1].time_s,
                         output_tokens=tokens, error=error)


def test_one_class_slos_are_3x_ttft_and_1_5x_tpot_medians():
    records = [record(i, t, p) for i, (t, p) in enumerate([(1.0, 0.04), (2.0, 0.05),
                                                            (9.0, 0.20)])]
    c = calibrate(records, "vllm")
    u = c.unloaded["default"]
    assert (u.num_requests, u.ttft_p50_s) == (3, 2.0)
    assert u.tpot_p50_s == pytest.approx(0.05)
    assert u.e2e_p50_s == pytest.approx(2.0 + 4 * 0.05)
    slos = c.slos()
    assert slos.by_class == {}
    assert slos.default.ttft_s == pytest.approx(6.0)
    assert slos.default.tpot_s == pytest.approx(0.075)
    assert c.source_note() == "ttft and tpot from vllm's unloaded p50 x 3 (TTFT) / 1.5 (TPOT)"


def test_classes_get_their_own_slos_and_the_start_weights_their_e2e():
    records = ([record(i, 0.5, 0.04, cls="interactive") for i in range(4)]
               + [record(10 + i, 4.0, 0.05, cls="offline") for i in range(2)])
    c = calibrate(records, "vllm")
    slos = c.slos()
    assert set(slos.by_class) == {"interactive", "offline"}
    assert slos.of("interactive").ttft_s == pytest.approx(1.5)
    assert slos.of("offline").ttft_s == pytest.approx(12.0)
    assert slos.of("offline").tpot_s == pytest.approx(0.075)
    e2e_i, e2e_o = 0.5 + 4 * 0.04, 4.0 + 4 * 0.05
    assert c.mean_e2e_s({"interactive": 0.75, "offline": 0.25}) == pytest.approx(
        0.75 * e2e_i + 0.25 * e2e_o)


def test_given_fields_override_the_calibrated_ones():
    c = calibrate([record(0, 1.0, 0.04)], "vllm", given=SLO(ttft_s=0.5))
    assert c.slos().default.ttft_s == 0.5
    assert c.slos().default.tpot_s == pytest.approx(0.06)
    assert "tpot from vllm" in c.source_note() and "other given" in c.source_note()
    both = calibrate([record(0, 1.0, 0.04)], "vllm", given=SLO(0.5, 0.1))
    assert both.slos().default == SLO(0.5, 0.1)
    assert both.source_note().startswith("given on the command line")


def test_a_failed_unloaded_request_or_no_decode_phase_is_an_error():
    with pytest.raises(CalibrationError, match="1 of 2 requests failed \\(UNAVAILABLE"):
        unloaded([record(0, 1.0, 0.04), record(1, 1.0, 0.04, error="UNAVAILABLE")])
    with pytest.raises(CalibrationError, match="no TPOT"):
        unloaded([record(0, 1.0, 0.04, tokens=1)])


def test_slo_table_judges_each_record_by_its_class():
    table = SLOTable(by_class={"interactive": SLO(1.0, 0.1), "offline": SLO(10.0, 0.1)})
    slow_start = [record(0, 5.0, 0.05, cls="interactive"), record(1, 5.0, 0.05, cls="offline")]
    assert [table.met_by(r) for r in slow_start] == [False, True]
    assert SLO(1.0).of("anything") == SLO(1.0)
    assert table.of("batch") == SLO()  # not calibrated: unconstrained
