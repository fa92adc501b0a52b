"""Which NVIDIA GPUs a stack's workers get, decided before any engine (or torch) loads.

`pdserve up` on a GPU machine: one GPU per worker while there are enough; else the prefill
tier takes the first half of the GPUs and decode the second, and workers of a tier share
their half (each with its share of the memory); one GPU: every worker shares it. Each
worker sees only its GPU (CUDA_VISIBLE_DEVICES), so it always uses device 0.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
from dataclasses import dataclass

# Of a GPU's memory, what vLLM may take in all (its default gpu_memory_utilization).
GPU_MEMORY_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class Placement:
    cuda_visible_devices: str
    gpu_memory_utilization: float


def visible_gpus() -> list[str]:
    """GPU indices this process may use: CUDA_VISIBLE_DEVICES if set, else what nvidia-smi
    lists, else the /dev/nvidiaN device files; [] without NVIDIA GPUs."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d for d in given.split(",") if d.strip() and d.strip() != "-1"]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
            return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return [str(i) for i in range(len(glob.glob("/dev/nvidia[0-9]*")))]


def assign(gpus: list[str], num_prefill: int, num_decode: int) -> tuple[list[Placement], list[Placement]] | None:
    """Per prefill and per decode worker, its GPU and memory share; None: no GPU (CPU)."""
    if not gpus:
        return None
    if len(gpus) >= num_prefill + num_decode:
        prefill_gpus, decode_gpus = gpus[:num_prefill], gpus[num_prefill:num_prefill + num_decode]
    elif len(gpus) >= 2:
        half = len(gpus) // 2
        prefill_gpus, decode_gpus = gpus[:half], gpus[half:]
    else:
        prefill_gpus = decode_gpus = gpus
    prefill = [prefill_gpus[i % len(prefill_gpus)] for i in range(num_prefill)]
    decode = [decode_gpus[i % len(decode_gpus)] for i in range(num_decode)]
    sharers = {g: (prefill + decode).count(g) for g in gpus}
    share = lambda g: round(GPU_MEMORY_SHARE / sharers[g], 3)  # noqa: E731
    return [Placement(g, share(g)) for g in prefill], [Placement(g, share(g)) for g in decode]


def default_kv_transports() -> tuple[str, ...]:
    """What a worker serves or reads when not told: the GPU transports where its KV cache
    will be on a GPU, shared memory on a CPU; tcp and nccl (gloo on CPU) everywhere."""
    return ("cuda_ipc", "tcp", "nccl") if visible_gpus() else ("shm", "tcp", "nccl")
