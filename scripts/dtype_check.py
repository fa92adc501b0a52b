"""Plain vLLM (no pdserve) answering one chat question greedily in a given dtype, to check
that a CPU's bf16 path gives the model's answer: `python scripts/dtype_check.py bfloat16`
and `... float32` (docs/benchmarks.md, ninth session; pdserve.engine.resolve_dtype)."""

import argparse


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dtype", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--model", default=None, help="default: pdserve's prepared model")
    p.add_argument("--question", default="What is the capital of France?")
    args = p.parse_args()
    import os

    from vllm import LLM, SamplingParams

    from pdserve.model import default_model_path

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(model=args.model or str(default_model_path()), dtype=args.dtype, enforce_eager=True,
              max_model_len=1024, block_size=32)
    out = llm.chat([{"role": "user", "content": args.question}],
                   SamplingParams(max_tokens=32, temperature=0))
    print(f"{args.dtype}: {out[0].outputs[0].text!r}")


if __name__ == "__main__":
    from pdserve import tempdirs

    with tempdirs.engine_dir_of_this_process():  # vLLM's socket files go with it
        main()
