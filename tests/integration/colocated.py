"""The reference: one colocated vLLM engine with the workers' settings, greedy, one prompt at
a time. Run as a script so its engine lives and dies in its own process.

    python tests/integration/colocated.py MODEL PROMPTS.json MAX_TOKENS OUT.json
"""

import json
import sys


def main() -> None:
    model, prompts_path, max_tokens, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from pdserve.engine import resolve_dtype

    # The same engine settings as `pdserve up` gives each worker (pdserve/engine.py).
    llm = LLM(model, dtype=resolve_dtype(), block_size=32, enforce_eager=True, enable_prefix_caching=True,
              max_num_seqs=64)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    outputs = []
    for prompt in json.load(open(prompts_path)):
        result = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        outputs.append(list(result.outputs[0].token_ids))
    json.dump(outputs, open(out_path, "w"))


if __name__ == "__main__":
    main()
