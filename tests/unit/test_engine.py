"""EngineSampling -> vLLM SamplingParams."""

from pdserve.engine import sampling_params
from protos import worker_pb2


def test_stream_interval_reaches_vllm_and_zero_means_every_step():
    from vllm.sampling_params import RequestOutputKind

    coalesced = sampling_params(worker_pb2.EngineSampling(max_tokens=9, top_p=1.0, stream_interval=4), 9)
    assert (coalesced.stream_interval, coalesced.output_kind) == (4, RequestOutputKind.DELTA)
    assert sampling_params(worker_pb2.EngineSampling(max_tokens=9, top_p=1.0), 9).stream_interval is None
