"""Why a request failed, decided once for every API: the one place errors are classified (`CODES`:
kind -> HTTP status and gRPC code; docs/api.md#errors-and-status-codes). Only the client's faults are
4xx; a lost replica ("lost") is one the router fails over from first (`replica_lost`); anything
unclassified is a bug: 500 / INTERNAL, with only the exception's type shown to the client.
"""

from __future__ import annotations

import asyncio
from typing import Literal, NamedTuple

import grpc

from mmserve.errors import (InvalidRequest, NotReady, Overloaded, QueueFull, ReplicaLost, RequestTooLarge,
                            ShuttingDown, Unauthenticated)

Kind = Literal["invalid", "too_large", "unauthenticated", "busy", "overloaded", "lost", "unavailable", "deadline",
               "internal"]
# kind -> (HTTP status, gRPC status code)
CODES: dict[str, tuple[int, grpc.StatusCode]] = {kind: (http, getattr(grpc.StatusCode, code)) for kind, http, code in (
    ("invalid", 400, "INVALID_ARGUMENT"), ("too_large", 413, "INVALID_ARGUMENT"),
    ("unauthenticated", 401, "UNAUTHENTICATED"), ("busy", 429, "RESOURCE_EXHAUSTED"),
    ("overloaded", 503, "RESOURCE_EXHAUSTED"), ("lost", 503, "UNAVAILABLE"), ("unavailable", 503, "UNAVAILABLE"),
    ("deadline", 504, "DEADLINE_EXCEEDED"), ("internal", 500, "INTERNAL"))}


class Failure(NamedTuple):
    """How every API reports a failed request: `kind` (see CODES) and a client-safe message."""

    kind: Kind
    message: str

    @property
    def http_status(self) -> int:
        return CODES[self.kind][0]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return CODES[self.kind][1]


def root_cause(e: BaseException) -> BaseException:
    """The exception a replica raised, through Ray's task-error wrappers."""
    while getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    return e


def client_error(e: BaseException) -> BaseException:
    """The `InvalidRequest` a replica raised, out of Ray's wrappers (the next hop answers it as
    the client's fault), else `e` itself."""
    cause = root_cause(e)
    return InvalidRequest(str(cause)) if isinstance(cause, InvalidRequest) else e


def _replica_lost() -> tuple[type[BaseException], ...]:
    from ray import exceptions as ray_exceptions
    from ray.serve import exceptions as serve_exceptions

    # ActorDiedError is a RayActorError; Serve raises ReplicaUnavailableError for a replica it
    # cannot reach
    return (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError,
            serve_exceptions.ReplicaUnavailableError, ReplicaLost)


def replica_lost(e: BaseException) -> bool:
    """True when `e` means the replica serving the request died or cannot be reached: the
    request itself is fine and may run again on another replica."""
    return any(isinstance(error, _replica_lost()) for error in (e, root_cause(e)))


def _unavailable() -> tuple[type[BaseException], ...]:
    from ray.serve import exceptions as serve_exceptions

    from mmserve.rpc.encoder_client import EmbeddingNotFound

    return (serve_exceptions.DeploymentUnavailableError, EmbeddingNotFound)


def _out_of_memory(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.OutOfMemoryError) or "OutOfMemoryError" in type(e).__name__


def classify(e: BaseException) -> Failure:
    from ray import exceptions as ray_exceptions
    from ray.serve import exceptions as serve_exceptions

    cause = root_cause(e)
    for error_type, kind in ((RequestTooLarge, "too_large"), (InvalidRequest, "invalid"),
                             (Unauthenticated, "unauthenticated")):
        if isinstance(cause, error_type):
            return Failure(kind, str(cause))
    for error in (e, cause):
        if isinstance(error, (ShuttingDown, NotReady)):
            return Failure("unavailable", f"{error}; retry shortly")
        if isinstance(error, QueueFull):
            return Failure("busy", f"server busy: {error}; retry later")
        if isinstance(error, Overloaded):
            return Failure("overloaded", f"server overloaded: {error}; retry later")
        if _out_of_memory(error):
            return Failure("overloaded", "server overloaded: out of device memory; retry later")
        if isinstance(error, serve_exceptions.BackPressureError):
            return Failure("busy", "server busy: request queue full; retry later")
        if isinstance(error, _replica_lost()):
            return Failure("lost", f"a backend replica was lost: {type(error).__name__}; retry later")
        if isinstance(error, _unavailable()) or (
            isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNAVAILABLE
        ):  # (the second: a standalone encoder that cannot be reached)
            return Failure("unavailable", f"a backend is unavailable: {type(error).__name__}")
        if isinstance(error, (TimeoutError, asyncio.TimeoutError, ray_exceptions.GetTimeoutError)):
            return Failure("deadline", "deadline exceeded")
    return Failure("internal", f"internal error: {type(cause).__name__}")
