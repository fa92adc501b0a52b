"""gRPC plumbing every pdserve server shares: status errors, health, reflection, lifecycle.

Errors by audience: a caller's mistake raises one of the ``RpcError`` subclasses below with a
message that says what to change; ``rpc_errors`` turns it into that gRPC status. Anything
else is a bug: logged with its traceback and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

logger = logging.getLogger(__name__)


class RpcError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(RpcError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPrecondition(RpcError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(RpcError):
    """Over capacity; ``retry_after_s`` goes to the caller as google.rpc.RetryInfo."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(RpcError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(RpcError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(RpcError):
    code = grpc.StatusCode.NOT_FOUND


# Statuses a worker answers that the gateway passes on to its caller unchanged.
PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.CANCELLED,
}

F = TypeVar("F", bound=Callable[..., Any])


def retry_info_metadata(code: grpc.StatusCode, message: str, retry_after_s: float) -> tuple:
    """Trailing metadata carrying a google.rpc.Status with a RetryInfo detail, as
    grpcio-status writes it (clients read it with rpc_status.from_call)."""
    from google.protobuf import any_pb2, duration_pb2
    from google.rpc import code_pb2, error_details_pb2, status_pb2
    from grpc_status import rpc_status

    delay = duration_pb2.Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[detail])
    return rpc_status.to_status(status).trailing_metadata


def status_of(e: BaseException, name: str) -> tuple[grpc.StatusCode, str]:
    """The status a handler named ``name`` answers for ``e`` (a bug is logged as one)."""
    if isinstance(e, RpcError):
        return e.code, str(e)
    if isinstance(e, grpc.aio.AioRpcError):
        # A downstream call failed; its status says whose fault it is.
        code = e.code() if e.code() in PASS_THROUGH else grpc.StatusCode.UNAVAILABLE
        return code, f"{e.details()}"
    if _is_vllm_client_error(e):
        # vLLM refused the request itself (a sampling value it does not take): the caller's.
        return grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}"
    logger.exception("bug in %s", name, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error in {name}: {type(e).__name__}"


def _is_vllm_client_error(e: BaseException) -> bool:
    """vLLM's errors caused by the request (vllm.exceptions.VLLMClientError, its 4xx), told
    by name so that processes without vLLM (the gateway) need not import it. Seen: a worker's
    Decode called with top_p 0 answered INTERNAL ("bug in DecodeServicer.Decode:
    VLLMValidationError")."""
    return any(c.__name__ == "VLLMClientError" and c.__module__ == "vllm.exceptions" for c in type(e).__mro__)


async def _abort(context: grpc.aio.ServicerContext, e: BaseException, name: str) -> None:
    code, message = status_of(e, name)
    if isinstance(e, ResourceExhausted) and e.retry_after_s is not None:
        await context.abort(code, message, retry_info_metadata(code, message, e.retry_after_s))
    await context.abort(code, message)


def rpc_errors(handler: F) -> F:
    """Maps exceptions of a unary or server-streaming async handler to gRPC statuses."""
    name = handler.__qualname__
    if _is_async_gen(handler):

        @functools.wraps(handler)
        async def stream(self, request, context) -> AsyncIterator[Any]:
            try:
                async for item in handler(self, request, context):
                    yield item
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:  # noqa: BLE001 - mapped, or logged as a bug
                await _abort(context, e, name)

        return stream  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary(self, request, context):
        try:
            return await handler(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            await _abort(context, e, name)

    return unary  # type: ignore[return-value]


def _is_async_gen(fn: Callable[..., Any]) -> bool:
    import inspect

    return inspect.isasyncgenfunction(fn)


def add_standard_services(server: grpc.aio.Server, service_names: Iterable[str]) -> health.HealthServicer:
    """Health checking (all services start NOT_SERVING) and server reflection."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


async def set_serving(health_servicer: health.HealthServicer, names: Iterable[str], serving: bool) -> None:
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in ["", *names]:
        await health_servicer.set(name, status)


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Binds an insecure port; returns the bound port (useful with port 0)."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port} (in use?)")
    return bound


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, so servers drain instead of dying mid-request."""
    event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


class Health(enum.Enum):
    SERVING = "serving"
    NOT_SERVING = "not serving"  # said so, or nothing listens there
    NO_ANSWER = "no answer"  # alive or not, it did not answer in time


async def health_status(channel: grpc.aio.Channel | health_pb2_grpc.HealthStub, service: str = "",
                        timeout_s: float = 2.0) -> Health:
    """Asks ``channel`` (or a HealthStub made while its channel was open: a stub made on a
    closed channel blocked the whole process in grpcio 1.85's method registration, seen when
    the gateway polled a replaced worker)."""
    stub = channel if isinstance(channel, health_pb2_grpc.HealthStub) else health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        return Health.NO_ANSWER if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else Health.NOT_SERVING
    except grpc.aio.UsageError:  # the channel was closed
        return Health.NOT_SERVING
    return Health.SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else Health.NOT_SERVING


async def check_health(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 2.0) -> bool:
    return await health_status(channel, service, timeout_s) is Health.SERVING


CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    # A restarted peer is back within seconds: retry connecting at least every 2 s (gRPC's
    # default backoff grows to 120 s, failing every call fast meanwhile).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # gRPC shares subchannels between channels to one address by default: a fresh channel
    # to a restarted worker would inherit the dead one's reconnect backoff and fail its
    # first calls (seen in CI: "Connection refused" 0.2 s after the new worker registered).
    ("grpc.use_local_subchannel_pool", 1),
]
