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

    assert WorkerConfig(role="decode", model="m").long_prefill_threshold == DECODE_LONG_PREFILL_TOKENS == 128
    assert WorkerConfig(role="prefill", model="m").long_prefill_threshold == 0
    assert WorkerConfig(role="decode", model="m", long_prefill_tokens=0).long_prefill_threshold == 0
    assert WorkerConfig(role="prefill", model="m", long_prefill_tokens=512).long_prefill_threshold == 512
    with pytest.raises(ValueError, match="--long-prefill-tokens must be >= 0"):
        WorkerConfig(role="decode", model="m", long_prefill_tokens=-1)


def test_a_decode_engine_steps_at_most_512_tokens_so_a_lone_long_prompt_is_chunked_too():
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
        WorkerConfig(role="decode", model="m", max_num_batched_tokens=64)


def test_the_decode_engines_default_cap_is_a_floor_and_the_gateway_is_told_the_chunk_beside_one_request():
    """Adaptive (max(cap, step / n) with n requests) by default on a decode worker, so that
    two long prompts' chunks leave a short prompt room; a cap given is fixed unless asked."""
    from types import SimpleNamespace

    from pdserve.config import WorkerConfig
    from pdserve.engine import reported_chunk

    assert WorkerConfig(role="decode", model="m").adaptive_chunks
    assert not WorkerConfig(role="prefill", model="m").adaptive_chunks
    assert not WorkerConfig(role="decode", model="m", long_prefill_tokens=256).adaptive_chunks
    assert WorkerConfig(role="decode", model="m", long_prefill_tokens=256, long_prefill_adaptive=True).adaptive_chunks
    assert not WorkerConfig(role="decode", model="m", long_prefill_adaptive=False).adaptive_chunks
    assert not WorkerConfig(role="decode", model="m", long_prefill_tokens=0, long_prefill_adaptive=True).adaptive_chunks

    def sched(cap, adaptive, step):
        return SimpleNamespace(long_prefill_token_threshold=cap, long_prefill_token_threshold_adaptive=adaptive,
                               max_num_batched_tokens=step)

    assert reported_chunk(sched(128, True, 512)) == 256  # beside one other request: 512 / 2
    assert reported_chunk(sched(384, True, 512)) == 384
    assert reported_chunk(sched(256, False, 512)) == 256
    assert reported_chunk(sched(0, True, 2048)) == 0


def test_a_cpu_engine_computes_in_its_engine_core_process_with_the_binding_an_mp_worker_gets(monkeypatch):
    """uni: vLLM's uni executor kept on a CPU (vLLM makes it mp there), with vLLM's own
    OpenMP environment for the binding in force only while the engine-core process starts."""
    from types import SimpleNamespace

    import pytest

    from pdserve.config import WorkerConfig
    from pdserve.engine import computes_in_engine_core

    def config(world_size=1):
        parallel = SimpleNamespace(world_size=world_size, local_world_size=world_size,
                                   data_parallel_rank_local=None, _api_process_count=1,
                                   distributed_executor_backend="mp")
        return SimpleNamespace(parallel_config=parallel, kv_transfer_config=object())

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    for name in ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    uni = config()
    with computes_in_engine_core(uni, True):
        import os

        assert uni.parallel_config.distributed_executor_backend == "uni"
        assert (os.environ["OMP_NUM_THREADS"], os.environ["OMP_PLACES"], os.environ["OMP_PROC_BIND"]) == (
            "2", "{0,1}", "true")
    assert "OMP_NUM_THREADS" not in os.environ and "OMP_PLACES" not in os.environ
    for cfg, asked in ((config(), False), (config(world_size=2), True)):
        with computes_in_engine_core(cfg, asked):
            assert "OMP_PLACES" not in os.environ
        assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert WorkerConfig(role="decode", model="m").executor == "uni"
    with pytest.raises(ValueError, match="--executor must be one of"):
        WorkerConfig(role="decode", model="m", executor="ray")
