"""`pdserve generate`: stream one answer to the terminal."""

from __future__ import annotations

import sys

import grpc

from protos import generation_pb2, generation_pb2_grpc


def generate(args) -> int:
    request = generation_pb2.GenerateRequest(
        sampling=generation_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    )
    if args.chat:
        request.messages.add(role="user", content=args.prompt)
    else:
        request.prompt = args.prompt
    with grpc.insecure_channel(args.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            for reply in stub.Generate(request, timeout=args.timeout_s):
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
            print(f"\npdserve generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
