"""Workloads and arrival schedules: seeded determinism, ranges, class mix, prefixes."""

import json
import statistics

import pytest

from pdserve.bench.arrivals import arrival_gaps_s, arrival_offsets_s
from pdserve.bench.workload import (
    TOKEN_ID_HIGH,
    TOKEN_ID_LOW,
    LengthRange,
    RequestClass,
    WorkloadConfig,
    build_workload,
    load_sharegpt_pairs,
    parse_class_mix,
    quantile_lengths,
    stratified_requests,
    take,
)


def test_same_seed_same_requests_other_seed_other_requests():
    cfg = WorkloadConfig(input_len=LengthRange(5, 50), output_len=LengthRange(3, 9))
    first = take(build_workload(cfg, seed=7), 20)
    assert first == take(build_workload(cfg, seed=7), 20)
    assert first != take(build_workload(cfg, seed=8), 20)
    # Ids are labels only: another prefix leaves the content unchanged.
    relabeled = take(build_workload(cfg, seed=7, id_prefix="run1-"), 20)
    assert [r.request_id for r in relabeled[:2]] == ["run1-0", "run1-1"]
    assert [(r.prompt_token_ids, r.output_len) for r in relabeled] == \
        [(r.prompt_token_ids, r.output_len) for r in first]


@pytest.mark.parametrize("kind", ["random", "classmix", "shared-prefix"])
def test_content_seed_changes_token_ids_and_keeps_lengths(kind):
    cfg = WorkloadConfig(kind=kind, input_len=LengthRange(5, 50), output_len=LengthRange(3, 9),
                         prefix_len=16, suffix_len=LengthRange(4, 8))
    base = take(build_workload(cfg, seed=3), 30)
    assert base == take(build_workload(cfg, seed=3, content_seed=3), 30)
    fresh = take(build_workload(cfg, seed=3, content_seed=4), 30)
    assert [(r.prompt_len, r.output_len, r.class_name) for r in fresh] == \
        [(r.prompt_len, r.output_len, r.class_name) for r in base]
    assert not {r.prompt_token_ids for r in fresh} & {r.prompt_token_ids for r in base}


def test_random_lengths_and_token_ids_stay_in_range():
    cfg = WorkloadConfig(input_len=LengthRange(64, 1536), output_len=LengthRange(32, 256))
    specs = take(build_workload(cfg, seed=0), 200)
    assert all(64 <= s.prompt_len <= 1536 and 32 <= s.output_len <= 256 for s in specs)
    assert all(TOKEN_ID_LOW <= t < TOKEN_ID_HIGH for s in specs for t in s.prompt_token_ids)
    assert {s.class_name for s in specs} == {"default"}


def test_length_range_parse():
    assert LengthRange.parse("64:1536") == LengthRange(64, 1536)
    assert LengthRange.parse("128") == LengthRange(128, 128)
    for bad in ("a:b", "10:5", "0:4"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


def test_classmix_follows_weights_and_carries_priorities():
    cfg = WorkloadConfig(kind="classmix", classes=parse_class_mix("interactive=3,offline=1"))
    specs = take(build_workload(cfg, seed=1), 400)
    counts = {name: sum(s.class_name == name for s in specs) for name in ("interactive",
                                                                          "offline")}
    assert counts["interactive"] + counts["offline"] == 400
    assert counts["interactive"] / 400 == pytest.approx(0.75, abs=0.05)
    assert {s.priority for s in specs if s.class_name == "interactive"} == {0}
    assert {s.priority for s in specs if s.class_name == "offline"} == {2}
    assert all(128 <= s.output_len <= 256 for s in specs if s.class_name == "offline")
    with pytest.raises(ValueError):
        parse_class_mix("vip=1")


def test_shared_prefix_groups_share_exactly_their_prefix():
    cfg = WorkloadConfig(kind="shared-prefix", num_prefix_groups=3, prefix_len=40,
                         suffix_len=LengthRange(5, 10))
    specs = take(build_workload(cfg, seed=2), 60)
    by_group: dict[str, set] = {}
    for s in specs:
        assert 45 <= s.prompt_len <= 50
        by_group.setdefault(s.class_name, set()).add(s.prompt_token_ids[:40])
    assert sorted(by_group) == ["group0", "group1", "group2"]
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == 3


def test_sharegpt_takes_first_human_turn_and_gpt_length(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "a b c d e"},
                           {"from": "gpt", "value": "w x y z"},
                           {"from": "human", "value": "ignored later turn"}]},
        {"conversations": [{"from": "human", "value": "too short"},
                           {"from": "gpt", "value": "p q r s t"}]},  # 2-token prompt
        {"conversations": [{"from": "gpt", "value": "no human turn here"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    tokenize = lambda text: [len(word) for word in text.split()]  # noqa: E731
    assert load_sharegpt_pairs(path, tokenize, 4096) == [((1, 1, 1, 1, 1), 4)]
    with pytest.raises(ValueError):
        load_sharegpt_pairs(path, tokenize, 8)  # the only usable pair needs 9 tokens
    cfg = WorkloadConfig(kind="sharegpt", dataset=path, tokenizer_path=tmp_path)
    specs = take(build_workload(cfg, seed=0, tokenize=tokenize), 3)
    assert [(s.prompt_token_ids, s.output_len) for s in specs] == [((1, 1, 1, 1, 1), 4)] * 3
    assert [s.request_id for s in specs] == ["req-0", "req-1", "req-2"]


def test_poisson_arrivals_have_the_requested_mean_rate():
    offsets = arrival_offsets_s(rate=4.0, burstiness=1.0, seed=0, n=4001)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.08)
    assert offsets == arrival_offsets_s(4.0, 1.0, 0, 4001)


def test_burstiness_changes_spread_not_mean():
    regular = [g for g, _ in zip(arrival_gaps_s(2.0, 4.0, seed=3), range(4000))]
    bursty = [g for g, _ in zip(arrival_gaps_s(2.0, 0.25, seed=3), range(4000))]
    assert statistics.fmean(regular) == pytest.approx(0.5, rel=0.05)
    assert statistics.fmean(bursty) == pytest.approx(0.5, rel=0.15)
    # Gamma with shape k: coefficient of variation 1 / sqrt(k).
    assert statistics.pstdev(regular) / statistics.fmean(regular) == pytest.approx(0.5, rel=0.1)
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.15)
    assert arrival_offsets_s(2.0, float("inf"), 0, 4) == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(ValueError):
        arrival_offsets_s(0.0, 1.0, 0, 3)


def test_presets_are_the_issues_workloads():
    from pdserve.bench.presets import class_weights, preset_workload, single_class

    short, long = preset_workload("short"), preset_workload("long", max_model_len=8192)
    assert (short.kind, short.input_len, short.output_len) == ("random", LengthRange(16, 64),
                                                               LengthRange(16, 64))
    assert (long.input_len, long.output_len, long.max_model_len) == (
        LengthRange(512, 2048), LengthRange(32, 128), 8192)
    mixed = preset_workload("mixed")
    assert class_weights(mixed) == {"interactive": 0.75, "offline": 0.25}
    assert class_weights(short) == {"default": 1.0}
    requests = take(build_workload(mixed, seed=0), 400)
    interactive = [r for r in requests if r.class_name == "interactive"]
    offline = [r for r in requests if r.class_name == "offline"]
    assert 0.7 < len(interactive) / 400 < 0.8
    assert {r.priority for r in interactive} == {0} and {r.priority for r in offline} == {2}
    assert all(32 <= r.prompt_len <= 256 and 16 <= r.output_len <= 64 for r in interactive)
    assert all(512 <= r.prompt_len <= 2048 and 32 <= r.output_len <= 128 for r in offline)
    alone = take(build_workload(single_class(mixed, "offline"), seed=0), 20)
    assert {r.class_name for r in alone} == {"offline"}
    assert single_class(short, "default") is short
    with pytest.raises(ValueError, match="want one of short, long, mixed"):
        preset_workload("huge")


def test_quantile_lengths_are_the_middles_of_equal_shares_of_the_range():
    # long's prompts: the median of the eight is the range's, 1,280.
    assert quantile_lengths(LengthRange(512, 2048), 8) == [608, 800, 992, 1184, 1376, 1568, 1760, 1952]
    assert statistics.median(quantile_lengths(LengthRange(512, 2048), 8)) == 1280
    assert quantile_lengths(LengthRange(16, 64), 4) == [22, 34, 46, 58]
    assert quantile_lengths(LengthRange(3, 3), 3) == [3, 3, 3]
    assert quantile_lengths(LengthRange(10, 20), 1) == [15]


def test_stratified_requests_take_the_quantiles_of_prompts_and_outputs():
    cfg = WorkloadConfig(input_len=LengthRange(512, 2048), output_len=LengthRange(32, 128))
    requests = stratified_requests(cfg, 8, seed=5, id_prefix="u-")
    assert [r.prompt_len for r in requests] == quantile_lengths(cfg.input_len, 8)
    assert sorted(r.output_len for r in requests) == [38, 50, 62, 74, 86, 98, 110, 122]
    assert [r.request_id for r in requests[:2]] == ["u-0", "u-1"]
    assert all(TOKEN_ID_LOW <= t < TOKEN_ID_HIGH for r in requests for t in r.prompt_token_ids)
    assert {(r.class_name, r.priority) for r in requests} == {("default", 0)}
    # The seed pairs outputs with prompts and picks the token ids; the lengths stay.
    assert requests == stratified_requests(cfg, 8, seed=5, id_prefix="u-")
    other = stratified_requests(cfg, 8, seed=6, id_prefix="u-")
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in requests]
    assert sorted(r.output_len for r in other) == sorted(r.output_len for r in requests)


def test_stratified_requests_of_one_class_carry_it_and_other_workloads_are_drawn():
    one = WorkloadConfig("classmix", classes=[
        RequestClass("interactive", 0, 1.0, LengthRange(32, 256), LengthRange(16, 64))])
    requests = stratified_requests(one, 4, seed=1, id_prefix="u-")
    assert [r.prompt_len for r in requests] == [60, 116, 172, 228]
    assert {(r.class_name, r.priority) for r in requests} == {("interactive", 0)}
    two = WorkloadConfig("classmix", classes=[
        RequestClass("interactive", 0, 0.5, LengthRange(32, 256), LengthRange(16, 64)),
        RequestClass("offline", 2, 0.5, LengthRange(512, 2048), LengthRange(32, 128))])
    assert stratified_requests(two, 4, seed=1, id_prefix="u-") is None
    assert stratified_requests(WorkloadConfig("shared-prefix"), 4, seed=1, id_prefix="u-") is None
