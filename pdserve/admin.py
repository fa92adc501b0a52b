"""`pdserve workers` and `pdserve drain`: an operator's view of a gateway's tiers."""

from __future__ import annotations

import json
import sys

import grpc
from google.protobuf import json_format

from protos import worker_pb2, worker_pb2_grpc

TIMEOUT_S = 10.0


def list_workers(args) -> int:
    try:
        with grpc.insecure_channel(args.gateway) as channel:
            reply = worker_pb2_grpc.RegistryStub(channel).ListWorkers(worker_pb2.ListWorkersRequest(), timeout=TIMEOUT_S)
    except grpc.RpcError as e:
        return _failed("workers", args.gateway, e)
    if args.json:
        print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True), indent=2))
        return 0
    print(format_table(list(reply.workers)))
    return 0


def drain_worker(args) -> int:
    try:
        with grpc.insecure_channel(args.gateway) as channel:
            reply = worker_pb2_grpc.RegistryStub(channel).Drain(
                worker_pb2.DrainRequest(worker_id=args.worker_id), timeout=TIMEOUT_S)
    except grpc.RpcError as e:
        return _failed("drain", args.gateway, e)
    w = reply.worker
    how = "it finishes what it runs and exits" if w.source == "registered" else "it gets no new work (static worker)"
    print(f"draining {w.role} worker {w.worker_id} at {w.address}: {how}")
    return 0


def format_table(workers: list[worker_pb2.WorkerStatus]) -> str:
    rows = [("ID", "TIER", "ADDRESS", "STATE", "SOURCE", "INFLIGHT", "RUNNING", "WAITING", "KV", "METRICS")]
    for w in sorted(workers, key=lambda w: (w.role != "prefill", w.address)):
        has_load = w.HasField("load")
        kv = f"{w.load.kv_usage:.0%}" if has_load and w.load.HasField("kv_usage") else "-"
        rows.append((w.worker_id or "-", w.role, w.address, w.state + (f" ({w.reason})" if w.reason else ""),
                     w.source, str(w.num_inflight), str(w.load.num_running) if has_load else "-",
                     str(w.load.num_waiting) if has_load else "-", kv, w.metrics_url or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def _failed(command: str, gateway: str, e: grpc.RpcError) -> int:
    print(f"pdserve {command}: gateway {gateway}: {e.code().name}: {e.details()}", file=sys.stderr)
    return 1
