"""`pdserve generate`: stream one answer to the terminal.

A stack that is not ready (nothing listening yet, or the gateway without a ready worker in
each tier) is one line on stderr and exit status 3, so scripts can tell it from a failed
request (1); `--wait [SECONDS]` waits for the gateway to be SERVING first.
"""

from __future__ import annotations

import sys

import grpc

from pdserve import probe
from protos import generation_pb2, generation_pb2_grpc

EXIT_FAILED = 1
EXIT_NOT_READY = 3


def generate(args) -> int:
    if args.wait is not None and not _wait_ready(args.address, args.wait):
        return EXIT_NOT_READY
    request = generation_pb2.GenerateRequest(
        sampling=generation_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    )
    if args.chat:
        request.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    if args.priority:
        request.priority = generation_pb2.Priority.Value(f"PRIORITY_{args.priority.upper()}")
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None and value < 0:
            print(f"pdserve generate: {flag} must be >= 0 (0: no objective)", file=sys.stderr)
            return EXIT_FAILED
    if args.slo_ttft_ms is not None:
        request.slo.ttft_ms = args.slo_ttft_ms
    if args.slo_tpot_ms is not None:
        request.slo.tpot_ms = args.slo_tpot_ms
    streamed = False
    with grpc.insecure_channel(args.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for reply in stub.Generate(request, timeout=args.timeout_s):
                streamed = True
                sys.stdout.write(reply.text)
                sys.stdout.flush()
                if reply.finish_reason:
                    sys.stdout.write("\n")
                    print(
                        f"[{reply.finish_reason}; {reply.usage.prompt_tokens} prompt + "
                        f"{reply.usage.completion_tokens} completion tokens]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and not streamed:
                print(not_ready_line(args.address, e), file=sys.stderr)
                return EXIT_NOT_READY
            retry = retry_after_s(e)
            hint = "" if retry is None else f" (the gateway suggests retrying in {retry:g} s)"
            end_line = "\n" if streamed else ""  # after the text streamed so far
            print(f"{end_line}pdserve generate: {e.code().name}: {e.details()}{hint}", file=sys.stderr)
            return EXIT_FAILED
    return 0


def retry_after_s(e: grpc.RpcError) -> float | None:
    """The google.rpc.RetryInfo delay the gateway sent with a refusal, in seconds; None
    without one."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    try:
        status = rpc_status.from_call(e)
    except ValueError:  # a status whose details disagree with its code or message
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


def not_ready_line(address: str, e: grpc.RpcError) -> str:
    """What to tell someone whose stack is not up yet, in one line."""
    reason = probe.unreachable_reason(e)
    if reason == "connection refused" or "failed to connect" in (e.details() or "").lower():
        return (f"pdserve generate: no gateway at {address} ({reason}); start the stack "
                f"(`pdserve up`) or add --wait to wait for it")
    return f"pdserve generate: the stack at {address} is not ready yet ({e.details()}); retry, or add --wait"


def _wait_ready(address: str, timeout_s: float) -> bool:
    def tell(health: probe.Health) -> None:
        print(f"pdserve generate: waiting for {address} to be SERVING: {health}", file=sys.stderr)

    health = probe.wait_serving(address, timeout_s, on_change=tell)
    if not health.serving:
        print(f"pdserve generate: {address} was not SERVING after {timeout_s:g} s ({health}); "
              f"is the stack up? (`pdserve up`)", file=sys.stderr)
    return health.serving
