import pytest

from gateway.request import check_prompt_fits, parse_request
from pdserve.rpc import InvalidArgument
from protos import generation_pb2


def request(**kw) -> generation_pb2.GenerateRequest:
    sampling = kw.pop("sampling", {})
    req = generation_pb2.GenerateRequest(**kw)
    for name, value in sampling.items():
        if isinstance(value, list):
            getattr(req.sampling, name).extend(value)
        else:
            setattr(req.sampling, name, value)
    return req


def test_defaults_apply_to_unset_sampling_fields():
    job = parse_request(request(prompt="hi"))
    assert job.prompt == "hi" and job.messages is None and job.token_ids is None
    s = job.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop) == (16, 1.0, 1.0, 0, None, ())
    assert len(job.request_id) == 32


def test_explicit_zero_temperature_is_greedy_not_default():
    assert parse_request(request(prompt="hi", sampling={"temperature": 0.0})).sampling.temperature == 0.0


def test_messages_and_token_ids_are_taken():
    job = parse_request(request(messages=[generation_pb2.ChatMessage(role="user", content="hey")]))
    assert job.messages == (("user", "hey"),)
    assert parse_request(request(token_ids=[5, 6])).token_ids == (5, 6)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({}, "set one of prompt, messages or token_ids"),
        ({"prompt": "a", "messages": [generation_pb2.ChatMessage(role="user", content="b")]},
         "got prompt and messages"),
        ({"prompt": "a", "token_ids": [1]}, "got prompt and token_ids"),
        ({"prompt": "   "}, "only whitespace"),
        ({"messages": [generation_pb2.ChatMessage(role="robot", content="b")]}, "messages[0].role is 'robot'"),
        ({"messages": [generation_pb2.ChatMessage(role="user", content="")]}, "content is empty"),
        ({"prompt": "a", "sampling": {"max_tokens": 0}}, "max_tokens must be >= 1"),
        ({"prompt": "a", "sampling": {"temperature": 2.5}}, "temperature must be in [0, 2]"),
        ({"prompt": "a", "sampling": {"temperature": float("nan")}}, "temperature must be in [0, 2]"),
        ({"prompt": "a", "sampling": {"top_p": 0.0}}, "top_p must be in (0, 1]"),
        ({"prompt": "a", "sampling": {"stop": [""]}}, "stop[0] must be 1-256"),
        ({"prompt": "a", "sampling": {"stop": ["x"] * 17}}, "at most 16"),
        ({"prompt": "a", "request_id": "r" * 129}, "longer than 128"),
    ],
)
def test_bad_requests_name_the_field(kw, says):
    with pytest.raises(InvalidArgument) as e:
        parse_request(request(**kw))
    assert says in str(e.value)


def test_prompt_limits():
    s = parse_request(request(prompt="a", sampling={"max_tokens": 10})).sampling
    check_prompt_fits([1] * 90, s, max_model_len=100, vocab_size=50)
    with pytest.raises(InvalidArgument, match="lower max_tokens to at most 9"):
        check_prompt_fits([1] * 91, s, max_model_len=100, vocab_size=50)
    with pytest.raises(InvalidArgument, match="the prompt has 100 tokens; the model's context is 100"):
        check_prompt_fits([1] * 100, s, max_model_len=100, vocab_size=50)
    with pytest.raises(InvalidArgument, match="token id 50 is outside the vocabulary"):
        check_prompt_fits([1, 50], s, max_model_len=100, vocab_size=50)
    with pytest.raises(InvalidArgument, match="tokenizes to nothing"):
        check_prompt_fits([], s, max_model_len=100, vocab_size=50)
