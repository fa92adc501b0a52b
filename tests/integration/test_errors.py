"""Bad input gets INVALID_ARGUMENT with a message that says what to change; the server lives on."""

import grpc
import pytest

from protos import generation_pb2


def call(stack, request):
    with stack.channel() as channel:
        return list(stack.stub(channel).Generate(request, timeout=60))


def user(content):
    return generation_pb2.ChatMessage(role="user", content=content)


@pytest.mark.parametrize(
    ("request_kw", "says"),
    [
        ({}, "set one of prompt, messages or token_ids"),
        ({"prompt": "hi", "messages": [user("hi")]}, "got prompt and messages"),
        ({"prompt": "hi", "sampling": generation_pb2.SamplingParams(temperature=3.0)}, "temperature"),
        ({"prompt": "hi", "sampling": generation_pb2.SamplingParams(top_p=1.5)}, "top_p"),
        ({"prompt": "hi", "sampling": generation_pb2.SamplingParams(max_tokens=0)}, "max_tokens"),
        ({"token_ids": [1] * 9000}, "the model's context is 8192"),
        ({"token_ids": [1] * 8000, "sampling": generation_pb2.SamplingParams(max_tokens=500)}, "lower max_tokens to at most 192"),
        ({"token_ids": [1, 10**9]}, "outside the vocabulary"),
        ({"messages": [generation_pb2.ChatMessage(role="wizard", content="x")]}, "role is 'wizard'"),
    ],
)
def test_bad_input_is_invalid_argument_with_a_useful_message(stack, request_kw, says):
    with pytest.raises(grpc.RpcError) as e:
        call(stack, generation_pb2.GenerateRequest(**request_kw))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert says in e.value.details()


def test_server_still_serves_after_bad_input(stack):
    with pytest.raises(grpc.RpcError):
        call(stack, generation_pb2.GenerateRequest())
    replies = call(stack, generation_pb2.GenerateRequest(prompt="Hi", sampling=generation_pb2.SamplingParams(max_tokens=2)))
    assert replies[-1].finish_reason in ("length", "stop")
