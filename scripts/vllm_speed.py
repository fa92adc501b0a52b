"""How fast this machine runs plain vLLM right now: a 1,300-token prefill and one request's
decode (a 40-token prompt, 65 tokens), three times, in float32 (or the dtype given).

    flock /tmp/pdserve-cpu.lock .venv/bin/python scripts/vllm_speed.py [DTYPE]

The first prefill includes the engine's warm-up and the repeats hit the prefix cache; the
decode figure (ms per token) is the one to compare within a session: this machine's speed
drifts (docs/benchmarks.md, "Tenth session")."""

import sys
import time

from vllm import LLM, SamplingParams

from pdserve import tempdirs
from pdserve.model import default_model_path


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
    llm = LLM(model=str(default_model_path()), dtype=dtype, block_size=32, max_model_len=4096, enforce_eager=True)
    for _ in range(3):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(range(100, 1400))}], SamplingParams(max_tokens=1, ignore_eos=True),
                     use_tqdm=False)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": list(range(100, 140))}], SamplingParams(max_tokens=65, ignore_eos=True),
                     use_tqdm=False)
        decode_s = time.perf_counter() - t
        print(f"prefill 1300 tokens {prefill_s:.3f} s; 40-token prompt + 65 tokens {decode_s:.3f} s "
              f"-> {decode_s / 65 * 1000:.1f} ms/token", flush=True)


if __name__ == "__main__":
    with tempdirs.engine_dir_of_this_process():  # vLLM's socket files go with it
        main()
