"""The systems a compare measures, as servers: how each is started (`pdserve up` with its
flags, a variant's checkout, pdserve-fifo as a second gateway over pdserve's workers,
colocated vLLM with pdserve's engine settings) and how the load generator talks to it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.bench import shared_fifo
from pdserve.bench.runner import BenchConfig
from pdserve.bench.servers import ServerSpec
from pdserve.bench.variants import REPO_ROOT, Variant

if TYPE_CHECKING:  # compare imports this module; the config is only an annotation here
    from pdserve.bench.compare import CompareConfig


# pdserve-fifo: the gateway without its serving policy, as the issue found it: arrival
# order, no admission, every prompt through the prefill tier. Placing short prompts on the
# decode worker is part of the policy under test (with it kept, fifo's interactive class
# already bypassed the offline prompts queued for prefill: 88.9% at the rate where fifo
# first fell below 90%, so no policy could be 30 points above it there).
PLAIN_FIFO_FLAGS = ("--policy", "fifo", "--local-prefill-max-tokens", "0")
# The `pdserve up` flags of each pdserve system but the variants.
PDSERVE_FLAGS = {"pdserve-fifo": PLAIN_FIFO_FLAGS, "pdserve": ()}


def pdserve_argv(port: int, model: Path, max_model_len: int, system: str = "pdserve",
                 variant: Variant | None = None) -> list[str]:
    # Metrics off: `up` would otherwise bind fixed ports that a concurrent stack may hold.
    # No flags for pdserve, so that a `pdserve up` without flags still serves the default
    # system.
    flags = variant.flags if variant is not None else PDSERVE_FLAGS[system]
    return [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), "--model",
            str(Path(model).resolve()), "--max-model-len", str(max_model_len), "--metrics-port", "0",
            *flags]


def source_root_env(root: Path | None = None) -> dict[str, str]:
    """PYTHONPATH with this checkout (or ``root``, a variant's) first, so `-m pdserve.cli`
    works uninstalled too and runs that checkout's code."""
    first = str(root or REPO_ROOT)
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": first + (os.pathsep + rest if rest else "")}


# vLLM's executor times an execute_model call out after VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS
# (300) of monotonic time, and that clock runs on while `--idle-systems freeze` holds a
# stack stopped: a call in flight at the freeze failed on the thaw after a 7-minute turn and
# killed the engine (the twelfth session's long rerun). Both systems get the same longer limit.
FREEZE_SAFE_ENV = {"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "7200"}


def idle_env(cfg: CompareConfig) -> dict[str, str]:
    return dict(FREEZE_SAFE_ENV) if cfg.freeze_idle else {}


def pdserve_spec(cfg: CompareConfig, port: int, system: str = "pdserve") -> ServerSpec:
    # `up` prints "pdserve ready at HOST:PORT"; the lines it relays from its processes
    # start with "[role]" (the gateway's own "[gateway] READY ..." comes before the
    # workers are up), so those are skipped, and gRPC health must then say SERVING.
    variant = cfg.variant(system)
    argv = pdserve_argv(port, cfg.model, cfg.bench.workload.max_model_len, system, variant)
    root = variant.source if variant is not None else None
    return ServerSpec(system, argv, {**source_root_env(root), **idle_env(cfg)},
                      ready_pattern=rf"^[^\[].*\bready\b.*:{port}\b",
                      grpc_health_target=f"127.0.0.1:{port}", boot_timeout_s=cfg.boot_timeout_s,
                      cwd=root)


def shared_fifo_spec(cfg: CompareConfig, port: int, pdserve_address: str) -> ServerSpec:
    """pdserve-fifo as a gateway with fifo's flags over the workers of the pdserve stack
    at ``pdserve_address`` (`shared_fifo`); SharedFifoError if it has none ready."""
    prefill, decode = shared_fifo.worker_addresses(pdserve_address)
    argv = shared_fifo.gateway_argv(port, str(Path(cfg.model).resolve()), prefill, decode,
                                    PDSERVE_FLAGS[shared_fifo.SYSTEM])
    return shared_fifo.gateway_spec(argv, port, {**source_root_env(), **idle_env(cfg)},
                                    cfg.boot_timeout_s)


def vllm_dtype() -> str:
    """The dtype pdserve's workers resolve by default (pdserve.engine.resolve_dtype): both
    systems compute in the same one."""
    from pdserve.engine import resolve_dtype

    return resolve_dtype()


def vllm_spec(cfg: CompareConfig, port: int) -> ServerSpec:
    # Block size, context length, dtype, eager mode and prefix caching as pdserve's engines.
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(cfg.model), "--dtype", vllm_dtype(), "--block-size", "32", "--max-model-len",
            str(cfg.bench.workload.max_model_len), "--enforce-eager", "--enable-prefix-caching",
            "--port", str(port), "--host", "127.0.0.1"]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": cfg.vllm_cpus, **idle_env(cfg)}
    return ServerSpec("vllm", argv, env, health_url=f"http://127.0.0.1:{port}/health",
                      boot_timeout_s=cfg.boot_timeout_s, engine_dir=True)


def bench_config_for(cfg: CompareConfig, system: str, address: str) -> BenchConfig:
    if system == "vllm":
        return dataclasses.replace(cfg.bench, backend="openai", base_url=address,
                                   model_name=None)
    salt = shared_fifo.CONTENT_SALT if (system == shared_fifo.SYSTEM
                                        and cfg.fifo_shares_engines()) else 0
    return dataclasses.replace(cfg.bench, backend="grpc", target=address, content_salt=salt)
