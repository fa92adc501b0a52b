"""pdserve.rpc: the status a handler answers for what it raised."""

import grpc

from pdserve import rpc


def test_a_request_vllm_refuses_is_the_caller_s_and_anything_else_a_bug():
    from vllm.exceptions import VLLMServerError, VLLMValidationError

    refused = VLLMValidationError("top_p must be in (0, 1], got 0.0.", parameter="top_p", value=0.0)
    assert rpc.status_of(refused, "DecodeServicer.Decode") == (
        grpc.StatusCode.INVALID_ARGUMENT, f"VLLMValidationError: {refused}")
    assert "top_p must be in (0, 1]" in rpc.status_of(refused, "DecodeServicer.Decode")[1]
    for bug in (VLLMServerError("engine"), ValueError("top_p"), RuntimeError("x")):
        assert rpc.status_of(bug, "DecodeServicer.Decode") == (
            grpc.StatusCode.INTERNAL, f"internal error in DecodeServicer.Decode: {type(bug).__name__}")
