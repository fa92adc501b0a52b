"""EngineSampling -> vLLM SamplingParams."""

from pdserve.engine import sampling_params
from protos import worker_pb2


def test_stream_interval_reaches_vllm_and_zero_means_every_step():
    from vllm.sampling_params import RequestOutputKind

    coalesced = sampling_params(worker_pb2.EngineSampling(max_tokens=9, top_p=1.0, stream_interval=4), 9)
    assert (coalesced.stream_interval, coalesced.output_kind) == (4, RequestOutputKind.DELTA)
    assert sampling_params(worker_pb2.EngineSampling(max_tokens=9, top_p=1.0), 9).stream_interval is None


def test_a_decode_engine_chunks_long_prefills_and_a_prefill_engine_does_not():
    import pytest

    from pdserve.config import DECODE_LONG_PREFILL_TOKENS, WorkerConfig

    assert WorkerConfig(role="decode", model="m").long_prefill_threshold == DECODE_LONG_PREFILL_TOKENS == 256
    assert WorkerConfig(role="prefill", model="m").long_prefill_threshold == 0
    assert WorkerConfig(role="decode", model="m", long_prefill_tokens=0).long_prefill_threshold == 0
    assert WorkerConfig(role="prefill", model="m", long_prefill_tokens=512).long_prefill_threshold == 512
    with pytest.raises(ValueError, match="--long-prefill-tokens must be >= 0"):
        WorkerConfig(role="decode", model="m", long_prefill_tokens=-1)


def test_a_decode_engine_steps_at_most_two_chunks_so_a_lone_long_prompt_is_chunked_too():
    """vLLM lifts the chunk cap for a prompt alone on the engine; the step budget chunks it."""
    import pytest

    from pdserve.config import DECODE_STEP_TOKENS, WorkerConfig

    assert WorkerConfig(role="decode", model="m").step_tokens == DECODE_STEP_TOKENS == 512
    assert WorkerConfig(role="decode", model="m", long_prefill_tokens=128).step_tokens == 256
    assert WorkerConfig(role="decode", model="m", long_prefill_tokens=16).step_tokens == 64  # max_num_seqs
    assert WorkerConfig(role="decode", model="m", long_prefill_tokens=0).step_tokens is None  # vLLM's default
    assert WorkerConfig(role="prefill", model="m").step_tokens is None
    assert WorkerConfig(role="decode", model="m", max_num_batched_tokens=2048).step_tokens == 2048
    with pytest.raises(ValueError, match="at least --long-prefill-tokens"):
        WorkerConfig(role="decode", model="m", max_num_batched_tokens=128)
