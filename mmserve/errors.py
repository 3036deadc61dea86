"""Errors that cross process boundaries with a meaning callers can act on.

`deployments.failures.classify` is the one place that maps these (and everything else) to
HTTP statuses and gRPC codes.
"""


class InvalidRequest(ValueError):
    """The request (or one of its media items) is invalid: HTTP 400 / gRPC INVALID_ARGUMENT.

    The message names the problem and is safe to show to the client.
    """


class RequestTooLarge(InvalidRequest):
    """The request body is over the configured size limit: HTTP 413 / gRPC INVALID_ARGUMENT."""


class Overloaded(RuntimeError):
    """A bounded resource is full (queued pixels, pinned results, device memory): the request
    was refused and may be retried later. HTTP 503 / gRPC RESOURCE_EXHAUSTED.

    The message says which resource and is safe to show to the client.
    """


class QueueFull(RuntimeError):
    """A queue bounded to keep latency in check is full: retry shortly. HTTP 429 (with Retry-After) /
    gRPC RESOURCE_EXHAUSTED. The message says which queue and is safe to show to the client."""
