"""The `pdserve` command: up | gateway | prefill | decode | generate | prepare-model | bench."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve import envvars
from pdserve.config import (DRAIN_GRACE_S, ENGINE_EXECUTORS, GATEWAY_POLICIES, STOP_GRACE_S, GatewayConfig,
                            WorkerConfig, per_class)


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="local HF model folder vLLM can load (default: SmolLM2-135M-Instruct, prepared once)")


def _resolve_model(args) -> None:
    from pdserve.model import resolve_model

    args.model = str(resolve_model(args.model))


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache size per CPU engine, GiB (whole)")
    p.add_argument("--block-size", type=int, default=32, help="tokens per KV block (a multiple of 32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--executor", choices=ENGINE_EXECUTORS, default="uni",
                   help="uni: a CPU engine computes in its engine-core process (one process beside the "
                        "worker's front end); mp: in a model-worker process of its own, as vLLM does on "
                        "CPUs by default (docs/benchmarks.md measures both); GPU engines of one device "
                        "run uni either way")


def _policy_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving policy (per class values: interactive,batch,offline)")
    g.add_argument("--policy", choices=GATEWAY_POLICIES, default="slo",
                   help="slo: classes by weight, earliest deadline first, admission by predicted "
                        "latency; fifo: arrival order, no admission beyond the queue bounds")
    g.add_argument("--slo-ttft-ms", default="0,0,0",
                   help="default time-to-first-token objective per class, ms (0: none)")
    g.add_argument("--slo-tpot-ms", default="0,0,0",
                   help="default time-per-output-token objective per class, ms (0: none)")
    g.add_argument("--class-weights", default="8,2,1", help="share of prefill work per class")
    g.add_argument("--queue-limits", default="256,512,1024", help="queued requests per class")
    g.add_argument("--aging-s", type=float, default=30.0,
                   help="a request queued this long is served next, whatever its class")
    g.add_argument("--prefill-queue-tokens", type=int, default=1024,
                   help="prompt tokens a prefill worker is sent beyond the one it runs")
    g.add_argument("--local-prefill-max-tokens", type=int, default=256,
                   help="longest prompt a decode worker may prefill itself when that is sooner (0: never)")
    g.add_argument("--rescue-prefill-max-tokens", type=int, default=4096,
                   help="longest prompt a decode worker may prefill itself when the prefill tier would miss "
                        "its TTFT objective and the decode worker's running requests can absorb the stall "
                        "(0: none longer than --local-prefill-max-tokens)")
    g.add_argument("--priority-hold-s", type=float, default=5.0,
                   help="slo policy: longest a request waits for a decode worker where its joining would make "
                        "a higher class's running requests miss their TPOT objectives (0: never)")
    g.add_argument("--stream-intervals", default="1,4,8",
                   help="tokens gathered into one streamed message per class (fewer messages, less CPU)")
    g.add_argument("--decode-stream", choices=("shared", "per-request"), default="shared",
                   help="shared: one DecodeStream call per decode worker carries every request's tokens, a "
                        "message per engine step; per-request: a Decode call per request, a message per "
                        "request per step")


def policy_argv(args) -> list[str]:
    """The policy flags as given, for `up` to pass on to its gateway."""
    return ["--policy", args.policy, "--slo-ttft-ms", args.slo_ttft_ms, "--slo-tpot-ms", args.slo_tpot_ms,
            "--class-weights", args.class_weights, "--queue-limits", args.queue_limits,
            "--aging-s", str(args.aging_s), "--prefill-queue-tokens", str(args.prefill_queue_tokens),
            "--local-prefill-max-tokens", str(args.local_prefill_max_tokens),
            "--rescue-prefill-max-tokens", str(args.rescue_prefill_max_tokens),
            "--priority-hold-s", str(args.priority_hold_s),
            "--stream-intervals", args.stream_intervals, "--decode-stream", args.decode_stream]


def cmd_up(args) -> int:
    from pdserve.launcher import up

    _resolve_model(args)
    return up(args)


def _worker_transports(text: str) -> tuple[str, ...]:
    if text == "auto":
        from pdserve.gpus import default_kv_transports

        return default_kv_transports()
    return tuple(t for t in text.split(",") if t)


def cmd_worker(args) -> int:
    _resolve_model(args)
    cfg = WorkerConfig(
        role=args.command,
        model=args.model,
        host=args.host,
        port=args.port,
        cpus=args.cpus,
        sched=args.sched,
        kv_cache_gib=args.kv_cache_gib,
        executor=args.executor,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        long_prefill_tokens=args.long_prefill_tokens,
        long_prefill_adaptive=args.long_prefill_adaptive,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=not args.compile,
        dtype=args.dtype,
        kv_transports=_worker_transports(args.kv_transport),
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_tcp_port=args.kv_tcp_port,
        kv_nccl_port=args.kv_nccl_port,
        kv_host=args.kv_host,
        kv_timeout_s=args.kv_timeout_s,
        kv_lease_s=args.kv_lease_s,
        kv_load_failure_policy=args.kv_load_failure_policy,
        metrics_port=args.metrics_port,
        json_logs=args.json_logs,
        gateway=args.gateway,
        advertise_host=args.advertise_host,
        drain_grace_s=args.drain_grace_s,
        **({"worker_id": args.worker_id} if args.worker_id else {}),
    )
    if cfg.role == "prefill":
        from prefill_worker.server import main
    else:
        from decode_worker.server import main
    return main(cfg)


def cmd_gateway(args) -> int:
    from gateway.serving import main

    _resolve_model(args)
    cfg = GatewayConfig(
        model=args.model,
        prefill_addrs=tuple(args.prefill),
        decode_addrs=tuple(args.decode),
        host=args.host,
        port=args.port,
        tokenizer_workers=args.tokenizer_workers,
        metrics_port=args.metrics_port,
        max_inflight=args.max_inflight,
        kv_transport=args.kv_transport,
        json_logs=args.json_logs,
        policy=args.policy,
        slo_ttft_ms=per_class(args.slo_ttft_ms, "--slo-ttft-ms", int),
        slo_tpot_ms=per_class(args.slo_tpot_ms, "--slo-tpot-ms", int),
        class_weights=per_class(args.class_weights, "--class-weights", float),
        queue_limits=per_class(args.queue_limits, "--queue-limits", int),
        aging_s=args.aging_s,
        prefill_queue_tokens=args.prefill_queue_tokens,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        rescue_prefill_max_tokens=args.rescue_prefill_max_tokens,
        priority_hold_s=args.priority_hold_s,
        stream_intervals=per_class(args.stream_intervals, "--stream-intervals", int),
        decode_stream=args.decode_stream,
        heartbeat_interval_s=args.heartbeat_interval_s,
        heartbeat_timeout_s=args.heartbeat_timeout_s,
        drain_grace_s=args.drain_grace_s,
    )
    return main(cfg)


def cmd_workers(args) -> int:
    from pdserve.admin import list_workers

    return list_workers(args)


def cmd_drain(args) -> int:
    from pdserve.admin import drain_worker

    return drain_worker(args)


def cmd_generate(args) -> int:
    from pdserve.client import generate

    return generate(args)


def cmd_prepare_model(args) -> int:
    from pdserve.model import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description=__doc__,
        epilog="Every flag can also be set by an environment variable, named in its --help line: "
               "--kv-cache-gib is PDSERVE_KV_CACHE_GIB. A flag on the command line wins; repeatable "
               "flags take a comma-separated list; on/off flags take 1/true/yes/on or 0/false/no/off.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("up", help="start the gateway and its prefill and decode workers on this host, supervised")
    _model_arg(p)
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--port", type=int, default=50051, help="gateway port")
    p.add_argument("--metrics-port", type=int, default=9400,
                   help="Prometheus ports: gateway here, prefill +1, decode +2 (0: off)")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--prefill", type=int, default=1, metavar="N",
                   help="prefill workers (0: none, the decode workers prefill every prompt)")
    p.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers")
    p.add_argument("--kv-transport", default="auto", choices=("auto", "shm", "tcp", "nccl", "cuda_ipc"),
                   help="KV transport between the tiers (auto: shared memory on CPU, CUDA IPC on a GPU; "
                        "both tiers run here)")
    p.add_argument("--kv-lease-s", type=float, default=30.0,
                   help="seconds a prompt's KV waits for its decode worker")
    p.add_argument("--kv-timeout-s", type=float, default=10.0, help="KV socket operations give up after this")
    p.add_argument("--cores", choices=("shared", "split"), default="shared",
                   help="shared: both engines on every core, the prefill engine at idle CPU priority so "
                        "decode steps come first and prefill takes every idle cycle; split: half the "
                        "cores each (docs/benchmarks.md measures both)")
    p.add_argument("--prefill-sched", choices=("idle", "normal"), default="idle",
                   help="with --cores shared: the prefill engine's CPU priority (normal: the two engines' "
                        "threads compete for the cores as equals)")
    p.add_argument("--decode-yield-ms", type=float, default=0.0,
                   help="with --cores shared: the decode engine sleeps this long at each step while the "
                        "prefill worker has prompts in hand, so that the idle-priority prefill engine gets "
                        "the cores for that slice (0: never)")
    p.add_argument("--decode-yield", choices=("off", "slack", "pace", "whole"), default="off",
                   help="with --cores shared: slack: while the prefill worker has prompts in hand, the "
                        "decode engine waits for it each step for up to 80%% of what its running requests' "
                        "TPOT objectives leave over (their lead so far and, for the tokens still to come, "
                        "what the objective leaves over the measured step time), at most 500 ms per step, "
                        "none while a request without an objective runs, and whole while a prompt's TTFT "
                        "objective leaves no more than its prefill on every core (kvtransfer.coreshare; "
                        "objectives from --slo-*-ms or the requests' slo); "
                        "pace: each step while the prefill worker has prompts in hand, the decode engine "
                        "waits for it up to 70%% of what the tightest running TPOT objective leaves over "
                        "the measured step time, and whole for urgent prompts as with slack; "
                        "whole: at a step while the prefill worker has prompts in hand the decode engine "
                        "waits until one of them is done (at most 2 s), so each prompt has every core and "
                        "decode makes a token between prompts, as colocated vLLM does between prefill "
                        "chunks; offline prompts never make it wait; neither with --decode-yield-ms")
    p.add_argument("--prefill-threads", choices=("team", "solo", "always"), default="team",
                   help="with --cores shared: team: the prefill engine computes on a thread per core; "
                        "solo: on one thread (on any core) while the decode engine is stepping, on all "
                        "while it idles, so that decode holding one core does not stall the prefill "
                        "engine's whole thread team (kvtransfer.prefill_threads.PrefillThreads); always: one "
                        "thread at every step")
    p.add_argument("--drain-grace-s", type=float, default=DRAIN_GRACE_S,
                   help="on SIGTERM or Ctrl-C: how long the answers in flight may take to finish (the "
                        "gateway's and each worker's grace); a child still running %.0f s after that is "
                        "killed" % STOP_GRACE_S)
    p.add_argument("--json-logs", action="store_true")
    _policy_args(p)
    p.set_defaults(func=cmd_up)

    for role in ("prefill", "decode"):
        p = sub.add_parser(role, help=f"run one {role} worker")
        _model_arg(p)
        _engine_args(p)
        p.add_argument("--host", default="127.0.0.1")
        p.add_argument("--port", type=int, default=0, help="0: any free port (printed in the READY line)")
        p.add_argument("--cpus", default=None, help="cores for the engine's threads, e.g. 0 or 0-3")
        p.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="GPU: fraction of the GPU's memory this engine may take (vLLM's; default 0.9)")
        p.add_argument("--sched", choices=("normal", "idle"), default="normal",
                       help="idle: the engine yields its cores to any other work (SCHED_IDLE)")
        p.add_argument("--max-num-seqs", type=int, default=64)
        p.add_argument("--long-prefill-tokens", type=int, default=None,
                       help="most tokens of one prompt's prefill per engine step while other requests run "
                            "(0: no cap; default: 128, adaptive, on a decode worker, so a short prompt need "
                            "not wait for a long one to finish, none on a prefill worker)")
        p.add_argument("--long-prefill-adaptive", action=argparse.BooleanOptionalAction, default=None,
                       help="treat --long-prefill-tokens as a floor: with n requests on the engine a long "
                            "prompt's chunk is max(cap, step / n), so a short prompt has room in a step "
                            "beside two long ones (vLLM's long_prefill_token_threshold_adaptive; default: "
                            "on with the decode worker's default cap)")
        p.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="most tokens one engine step computes (vLLM's; default on a decode worker: 512, "
                            "or twice --long-prefill-tokens when given, as vLLM lifts that cap for a prompt "
                            "alone on the engine; vLLM's own default on a prefill worker)")
        p.add_argument("--compile", action="store_true", help="torch.compile the model (slow first boot)")
        p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                       help="compute dtype (auto: the model's on a GPU, float32 on a CPU; README says why)")
        p.add_argument("--kv-transport", default="auto",
                       help="KV transports served (prefill) or read (decode), comma-separated: "
                            "shm, tcp, nccl (gloo on CPU), cuda_ipc; auto: cuda_ipc,tcp,nccl where the "
                            "engine has a GPU, else shm,tcp,nccl")
        p.add_argument("--kv-tcp-port", type=int, default=0, help="prefill: tcp transport port (0: free)")
        p.add_argument("--kv-nccl-port", type=int, default=0, help="prefill: nccl transport port (0: free)")
        p.add_argument("--kv-host", default=None, help="prefill: address decode workers reach the "
                                                       "tcp/nccl transports at (default: --host)")
        p.add_argument("--kv-timeout-s", type=float, default=10.0, help="KV socket operations give up after this")
        p.add_argument("--kv-lease-s", type=float, default=30.0,
                       help="prefill: seconds a prompt's KV waits for its decode worker")
        p.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="recompute")
        p.add_argument("--metrics-port", type=int, default=None)
        p.add_argument("--gateway", default=None, metavar="HOST:PORT",
                       help="register with this gateway and heartbeat (joins its tier at runtime)")
        p.add_argument("--advertise-host", default=None,
                       help="host the gateway reaches this worker at (default: --host, or the machine's "
                            "name when --host is 0.0.0.0)")
        p.add_argument("--drain-grace-s", type=float, default=DRAIN_GRACE_S,
                       help="on SIGTERM or `pdserve drain`: how long in-flight requests may take to finish")
        p.add_argument("--worker-id", default=None)
        p.add_argument("--json-logs", action="store_true")
        p.set_defaults(func=cmd_worker)

    p = sub.add_parser("gateway", help="run the gateway")
    _model_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--prefill", action="append", default=[],
                   help="prefill worker host:port (repeatable); more can join with `pdserve prefill --gateway`")
    p.add_argument("--decode", action="append", default=[],
                   help="decode worker host:port (repeatable); more can join with `pdserve decode --gateway`")
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0, help="registered workers heartbeat this often")
    p.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                   help="a registered worker silent this long leaves rotation")
    p.add_argument("--tokenizer-workers", type=int, default=1)
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--kv-transport", default="auto", choices=("auto", "shm", "tcp", "nccl", "cuda_ipc"),
                   help="KV transport between the tiers (auto: shared memory on one host, else the network)")
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--drain-grace-s", type=float, default=DRAIN_GRACE_S,
                   help="on SIGTERM or Ctrl-C: how long the calls in flight may take to finish before "
                        "those still streaming end with UNAVAILABLE")
    p.add_argument("--json-logs", action="store_true")
    _policy_args(p)
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("generate", help="stream an answer to the terminal")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="send as a user message (chat template applied)")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--priority", choices=("interactive", "batch", "offline"), default=None,
                   help="the request's class (the gateway's default: interactive)")
    p.add_argument("--slo-ttft-ms", type=int, default=None, metavar="MS",
                   help="time-to-first-token objective (0: none; default: the class's)")
    p.add_argument("--slo-tpot-ms", type=int, default=None, metavar="MS",
                   help="time-per-output-token objective (0: none; default: the class's)")
    p.add_argument("--wait", type=float, nargs="?", const=300.0, default=None, metavar="SECONDS",
                   help="wait up to SECONDS (300 if not given; put the flag after the prompt) for the "
                        "gateway to be SERVING; without it a stack not ready yet exits at once with status 3")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("workers", help="list the gateway's workers: tier, address, state, load, metrics URL")
    p.add_argument("--gateway", default="127.0.0.1:50051", metavar="HOST:PORT")
    p.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    p.set_defaults(func=cmd_workers)

    p = sub.add_parser("drain", help="stop sending work to a worker; a registered one finishes and exits")
    p.add_argument("worker_id", help="as `pdserve workers` lists it")
    p.add_argument("--gateway", default="127.0.0.1:50051", metavar="HOST:PORT")
    p.set_defaults(func=cmd_drain)

    p = sub.add_parser("prepare-model", help="convert the default model once (idempotent)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_prepare_model)

    try:
        from pdserve.bench.cli import register
    except ImportError:
        pass
    else:
        register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = envvars.parse_args(parser, argv, os.environ)
    if args.command == "up":
        # `up` hands its children every setting on their command lines; its own variables
        # must not reach them, where some mean something else (PDSERVE_KV_TRANSPORT=auto is
        # no worker transport; PDSERVE_HOST would move the workers off loopback).
        for var in envvars.command_vars(parser, args):
            os.environ.pop(var, None)
    if getattr(args, "metrics_port", None) == 0:
        args.metrics_port = None
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
