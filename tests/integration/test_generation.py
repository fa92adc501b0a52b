"""Generation through the real stack: gateway -> prefill -> KV handoff -> decode."""

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import generation_pb2
from tests.integration.conftest import IDENTITY_MAX_TOKENS, token_stream


def generate(stack, timeout_s=120, **kw) -> list[generation_pb2.GenerateResponse]:
    sampling = kw.pop("sampling", {})
    request = generation_pb2.GenerateRequest(**kw, sampling=generation_pb2.SamplingParams(**sampling))
    with stack.channel() as channel:
        return list(stack.stub(channel).Generate(request, timeout=timeout_s))


def test_greedy_output_is_token_identical_to_a_colocated_engine(stack, identity_prompts, reference_outputs):
    got = []
    for prompt in identity_prompts:
        replies = generate(stack, token_ids=prompt, sampling={"max_tokens": IDENTITY_MAX_TOKENS, "temperature": 0})
        got.append([t for r in replies for t in r.token_ids])
    mismatched = [(len(p), g, r) for p, g, r in zip(identity_prompts, got, reference_outputs) if g != r]
    assert not mismatched, f"differs from colocated vLLM (prompt length, pdserve, vllm): {mismatched}"


def test_decode_engine_receives_the_prompt_kv_instead_of_computing_it(stack, tokenizer):
    stream = token_stream(tokenizer)
    # Fresh prompts (offsets no other test uses): nothing of them is in either prefix cache.
    # Both longer than the stack's --local-prefill-max-tokens (256), so the prefill tier runs them.
    prompts = [stream[700:700 + 297], stream[1000:1000 + 480]]
    # Baselines: a counter no request has touched yet has no sample.
    received = stack.metric(2, "pdserve_kv_transfer_tokens_total", 'direction="recv"', default=0.0)
    sent = stack.metric(1, "pdserve_kv_transfer_tokens_total", 'direction="send"', default=0.0)
    handed_off = stack.metric(0, "pdserve_kv_handoff_tokens_total", default=0.0)
    for prompt in prompts:
        replies = generate(stack, token_ids=prompt, sampling={"max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert replies[-1].usage.completion_tokens == 8
    num_prompt_tokens = sum(len(p) for p in prompts)
    assert stack.metric(1, "pdserve_kv_transfer_tokens_total", 'direction="send"') - sent == num_prompt_tokens
    assert stack.metric(2, "pdserve_kv_transfer_tokens_total", 'direction="recv"') - received == num_prompt_tokens
    assert stack.metric(0, "pdserve_kv_handoff_tokens_total") - handed_off == num_prompt_tokens


def test_chat_answer_names_paris(stack):
    replies = generate(
        stack,
        messages=[generation_pb2.ChatMessage(role="user", content="What is the capital of France?")],
        sampling={"max_tokens": 32, "temperature": 0},
    )
    text = "".join(r.text for r in replies)
    assert "Paris" in text
    last = replies[-1]
    assert last.finish_reason == "stop"
    assert last.usage.completion_tokens == sum(len(r.token_ids) for r in replies)
    assert all(not r.finish_reason for r in replies[:-1])


def test_stream_carries_only_new_text_and_ends_with_length(stack):
    replies = generate(stack, prompt="Once upon a time", sampling={"max_tokens": 20, "temperature": 0, "ignore_eos": True})
    assert len(replies) >= 2  # the first token streams before decode starts
    assert replies[-1].finish_reason == "length"
    assert replies[-1].usage.completion_tokens == 20
    ids = [t for r in replies for t in r.token_ids]
    assert len(ids) == 20
    assert all(r.request_id == replies[0].request_id for r in replies)


def test_stop_string_cuts_the_text(stack):
    question = [generation_pb2.ChatMessage(role="user", content="What is the capital of France?")]
    full = "".join(r.text for r in generate(stack, messages=question, sampling={"max_tokens": 32, "temperature": 0}))
    assert "Paris" in full
    replies = generate(stack, messages=question, sampling={"max_tokens": 32, "temperature": 0, "stop": ["Paris"]})
    assert "".join(r.text for r in replies) == full[: full.index("Paris")]
    assert replies[-1].finish_reason == "stop"


def test_max_tokens_one_finishes_at_prefill(stack):
    replies = generate(stack, prompt="Hello there", sampling={"max_tokens": 1, "temperature": 0}, request_id="one-token")
    assert [r.finish_reason for r in replies] == ["length"]
    assert replies[0].request_id == "one-token"
    assert len(replies[0].token_ids) == 1 and replies[0].usage.completion_tokens == 1


def test_concurrent_requests_all_complete(stack):
    def one(i):
        return generate(stack, prompt=f"Count from {i}:", sampling={"max_tokens": 12, "temperature": 0, "ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert [r[-1].usage.completion_tokens for r in results] == [12] * 8


def test_a_cancelled_call_leaves_the_server_serving(stack):
    request = generation_pb2.GenerateRequest(
        prompt="Write a long story about a lighthouse.",
        sampling=generation_pb2.SamplingParams(max_tokens=200, ignore_eos=True),
    )
    with stack.channel() as channel:
        call = stack.stub(channel).Generate(request, timeout=60)
        next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
    assert generate(stack, prompt="Hi", sampling={"max_tokens": 3, "ignore_eos": True})[-1].usage.completion_tokens == 3
