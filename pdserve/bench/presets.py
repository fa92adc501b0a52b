"""Named workloads for `pdserve bench run` and `compare`: ``short``, ``long`` and ``mixed``.

A preset is a name for a `WorkloadConfig` (``--workload short`` is the same as
``--workload random --input-len-range 16:64 --output-len-range 16:64``), so `run` and
`compare` build exactly the same requests from it, and explicit length flags still
override its ranges.

- ``short``: chat turns; prompts and outputs of 16-64 tokens. Decode-bound: what matters
  is the time per output token of many small requests batched together.
- ``long``: retrieval-augmented answers and summaries; prompts of 512-2,048 tokens,
  outputs of 32-128. Prefill-bound: on a CPU a 1,500-token prompt is seconds of compute,
  and in a colocated engine every such prefill stalls the decode steps of the requests
  already running.
- ``mixed``: interactive requests (32-256 in, 16-64 out) under a flood of offline long
  ones (512-2,048 in, 32-128 out), each class with its priority and its own SLO. The
  shares are 75% interactive, 25% offline: an offline prompt is on average about 9 times
  the prompt tokens of an interactive one, so a quarter of the requests brings about 75% of
  the prefill work (the flood), while three quarters of the requests (30 of 40 per rate)
  are interactive, enough for a per-class attainment in steps of about 3%.
"""

from __future__ import annotations

from pdserve.bench.workload import LengthRange, RequestClass, WorkloadConfig

INTERACTIVE = "interactive"
OFFLINE = "offline"
PRESET_NAMES = ("short", "long", "mixed")

SHORT_INPUT, SHORT_OUTPUT = LengthRange(16, 64), LengthRange(16, 64)
LONG_INPUT, LONG_OUTPUT = LengthRange(512, 2048), LengthRange(32, 128)


def mixed_classes() -> list[RequestClass]:
    # Priorities follow vLLM's convention (lower is more urgent) and the class names are
    # the API's (PRIORITY_INTERACTIVE, PRIORITY_OFFLINE): the gRPC backend maps by name.
    return [
        RequestClass(INTERACTIVE, 0, 0.75, LengthRange(32, 256), LengthRange(16, 64)),
        RequestClass(OFFLINE, 2, 0.25, LONG_INPUT, LONG_OUTPUT),
    ]


def preset_workload(name: str, max_model_len: int = 4096) -> WorkloadConfig:
    """The `WorkloadConfig` a preset name stands for."""
    if name == "short":
        return WorkloadConfig("random", SHORT_INPUT, SHORT_OUTPUT, max_model_len=max_model_len)
    if name == "long":
        return WorkloadConfig("random", LONG_INPUT, LONG_OUTPUT, max_model_len=max_model_len)
    if name == "mixed":
        return WorkloadConfig("classmix", classes=mixed_classes(), max_model_len=max_model_len)
    raise ValueError(f"workload preset {name!r}: want one of {', '.join(PRESET_NAMES)}")


def class_weights(workload: WorkloadConfig) -> dict[str, float]:
    """Each request class of a workload and its share of the requests (summing to 1).

    Workloads without classes have the one class every `RequestSpec` defaults to.
    """
    if workload.kind != "classmix":
        return {"default": 1.0}
    total = sum(c.weight for c in workload.classes)
    return {c.name: c.weight / total for c in workload.classes}


def single_class(workload: WorkloadConfig, class_name: str) -> WorkloadConfig:
    """The workload restricted to one of its classes (calibration measures each alone)."""
    if workload.kind != "classmix":
        return workload
    (c,) = [c for c in workload.classes if c.name == class_name]
    return WorkloadConfig("classmix", classes=[RequestClass(c.name, c.priority, 1.0, c.input_len,
                                                            c.output_len)],
                          max_model_len=workload.max_model_len)
