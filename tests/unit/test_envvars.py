"""PDSERVE_* variables for every flag: on pdserve's own parser and on small ones."""

from __future__ import annotations

import argparse

import pytest

from pdserve import envvars
from pdserve.cli import build_parser


def parse(argv: list[str], **environ: str) -> argparse.Namespace:
    return envvars.parse_args(build_parser(), argv, environ)


def test_variable_names_come_from_the_long_flag():
    p = argparse.ArgumentParser()
    names = [envvars.env_var(p.add_argument(*flags, **kw)) for flags, kw in [
        (("--kv-cache-gib",), {}), (("-n", "--num-requests"), {}), (("--duration",), {"dest": "duration_s"}),
        (("-q",), {}), (("prompt",), {})]]
    assert names == ["PDSERVE_KV_CACHE_GIB", "PDSERVE_NUM_REQUESTS", "PDSERVE_DURATION", None, None]


def test_a_variable_sets_a_flag_not_given():
    args = parse(["decode"], PDSERVE_KV_CACHE_GIB="5", PDSERVE_DTYPE="float32", PDSERVE_KV_TIMEOUT_S="2.5")
    assert (args.kv_cache_gib, args.dtype, args.kv_timeout_s) == (5, "float32", 2.5)
    assert args.block_size == 32  # no variable: the flag's default


def test_the_flag_wins_over_its_variable():
    args = parse(["decode", "--kv-cache-gib", "3"], PDSERVE_KV_CACHE_GIB="5")
    assert args.kv_cache_gib == 3


def test_repeatable_flags_take_a_comma_separated_list():
    args = parse(["gateway"], PDSERVE_PREFILL="p0:1, p1:2", PDSERVE_DECODE="d0:3")
    assert (args.prefill, args.decode) == (["p0:1", "p1:2"], ["d0:3"])
    # Given on the command line, the flag replaces the variable's list (it does not add to it).
    args = parse(["gateway", "--prefill", "x:9", "--prefill", "y:8"], PDSERVE_PREFILL="p0:1", PDSERVE_DECODE="d0:3")
    assert (args.prefill, args.decode) == (["x:9", "y:8"], ["d0:3"])


def required_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tool")
    p.add_argument("--target", required=True)
    return p


def test_a_required_flag_with_neither_flag_nor_variable_still_fails(capsys):
    with pytest.raises(SystemExit) as exc:
        envvars.parse_args(required_parser(), [], {})
    assert exc.value.code == 2
    assert "the following arguments are required: --target" in capsys.readouterr().err


def test_a_variable_satisfies_a_required_flag():
    assert envvars.parse_args(required_parser(), [], {"PDSERVE_TARGET": "x:1"}).target == "x:1"


@pytest.mark.parametrize("word, value", [("1", True), ("yes", True), ("ON", True), ("0", False), ("false", False)])
def test_on_off_flags(word, value):
    assert parse(["decode"], PDSERVE_JSON_LOGS=word, PDSERVE_COMPILE=word).json_logs is value
    # store_false: --no-ignore-eos set means ignore_eos off.
    assert parse(["bench", "run"], PDSERVE_NO_IGNORE_EOS=word).ignore_eos is (not value)


def test_optional_value_flag_takes_its_number():
    assert parse(["generate", "hi"], PDSERVE_WAIT="60").wait == 60.0
    assert parse(["generate", "hi", "--wait"], PDSERVE_WAIT="60").wait == 300.0
    assert parse(["generate", "hi"]).wait is None


def test_flag_types_that_parse_lists_get_the_whole_text():
    # --rates is a store flag whose type splits the commas itself.
    assert parse(["bench", "run"], PDSERVE_RATES="0.5,1,2").rates == [0.5, 1.0, 2.0]


@pytest.mark.parametrize("environ, message", [
    ({"PDSERVE_KV_CACHE_GIB": "two"}, "PDSERVE_KV_CACHE_GIB='two' (for --kv-cache-gib): not a valid int"),
    ({"PDSERVE_DTYPE": "fp8"}, "PDSERVE_DTYPE='fp8' (for --dtype): choose from auto, float32, bfloat16, float16"),
    ({"PDSERVE_JSON_LOGS": "maybe"}, "PDSERVE_JSON_LOGS='maybe': want one of 1, true, yes, on or 0, false, no, off"),
])
def test_a_bad_value_names_its_variable(capsys, environ, message):
    with pytest.raises(SystemExit) as exc:
        parse(["decode"], **environ)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"pdserve decode: error: {message}"


def test_argument_type_errors_keep_their_message(capsys):
    with pytest.raises(SystemExit):
        parse(["bench", "run"], PDSERVE_RATES="1,fast")
    assert capsys.readouterr().err.splitlines()[-1] == (
        "pdserve bench run: error: PDSERVE_RATES='1,fast' (for --rates): want comma-separated numbers, got '1,fast'")


def test_only_the_command_that_runs_reads_its_variables():
    # Valid for a worker (a list), invalid for `up` (one choice): generate must not care.
    environ = {"PDSERVE_KV_TRANSPORT": "shm,tcp", "PDSERVE_POLICY": "bogus"}
    assert parse(["generate", "hi"], **environ).prompt == "hi"
    assert parse(["decode"], **environ).kv_transport == "shm,tcp"
    with pytest.raises(SystemExit):
        parse(["up"], **environ)


def test_help_lists_each_flags_variable():
    parser = build_parser()
    envvars.document(parser)
    envvars.document(parser)  # idempotent
    flags = {a.option_strings[-1]: a.help for p in envvars.parsers(parser) for a in p._actions
             if envvars.env_var(a)}
    assert flags["--kv-cache-gib"].endswith("[env: PDSERVE_KV_CACHE_GIB]")
    assert flags["--json-logs"] == "[env: PDSERVE_JSON_LOGS]"
    assert all(h.count("[env: PDSERVE_") == 1 for h in flags.values())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "[env: PDSERVE_PREFILL]" in " ".join(sub["gateway"].format_help().split())


def test_every_flag_of_every_command_has_a_variable():
    parser = build_parser()
    flags = [a for p in envvars.parsers(parser) for a in p._actions
             if a.option_strings and a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]
    assert flags and all(envvars.env_var(a) for a in flags)


def test_bench_kv_passes_its_arguments_through_untouched():
    args = parse(["bench", "kv", "--transport", "tcp"], PDSERVE_KV_ARGS="x", PDSERVE_TRANSPORT="shm")
    assert args.kv_args == ["--transport", "tcp"]


def test_parsing_leaves_the_parser_as_built():
    parser = build_parser()
    envvars.parse_args(parser, ["gateway"], {"PDSERVE_PREFILL": "p:1", "PDSERVE_DECODE": "d:2"})
    gateway = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["gateway"]
    prefill = next(a for a in gateway._actions if a.dest == "prefill")
    assert (prefill.default, prefill.required) == ([], False)


def test_up_variables_are_those_of_up():
    parser = build_parser()
    args = envvars.parse_args(parser, ["up"], {})
    names = envvars.command_vars(parser, args)
    assert {"PDSERVE_KV_TRANSPORT", "PDSERVE_HOST", "PDSERVE_POLICY", "PDSERVE_CORES"} <= names
    assert "PDSERVE_CPUS" not in names and "PDSERVE_PREFILL" in names  # a count for up, addresses for gateway


def test_up_keeps_its_variables_from_its_children(monkeypatch):
    import os

    from pdserve import cli

    seen: dict[str, str | None] = {}

    def fake_up(args) -> int:
        seen.update(host=args.host, env_host=os.environ.get("PDSERVE_HOST"), env_cpus=os.environ.get("PDSERVE_CPUS"))
        return 0

    monkeypatch.setattr(cli, "cmd_up", fake_up)
    monkeypatch.setenv("PDSERVE_HOST", "0.0.0.0")
    monkeypatch.setenv("PDSERVE_CPUS", "0")  # not a flag of `up`: a setting for its workers
    assert cli.main(["up"]) == 0
    assert seen == {"host": "0.0.0.0", "env_host": None, "env_cpus": "0"}
