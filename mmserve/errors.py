"""Errors that cross process boundaries with a meaning callers can act on.

`deployments.core.failures.classify` is the one place that maps these (and everything else) to
HTTP statuses and gRPC codes.
"""


class InvalidRequest(ValueError):
    """The request (or one of its media items) is invalid: HTTP 400 / gRPC INVALID_ARGUMENT.

    The message names the problem and is safe to show to the client.
    """


class Unauthenticated(Exception):
    """The API key is missing or wrong: HTTP 401 / gRPC UNAUTHENTICATED."""


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


class EngineError(RuntimeError):
    """An engine step failed (a bug, not the request's fault): HTTP 500 / gRPC INTERNAL."""


class ReplicaLost(RuntimeError):
    """This replica can no longer serve (a rank of its tensor-parallel group died): the request
    itself is fine and runs again on another replica, as when the replica's process dies."""


class ShuttingDown(RuntimeError):
    """The server is draining before it stops: HTTP 503 / gRPC UNAVAILABLE; retry elsewhere."""


class NotReady(RuntimeError):
    """The app is starting: a backend it needs has no replica that finished loading its model and
    warming up yet. HTTP 503 (with Retry-After) / gRPC UNAVAILABLE; retry shortly. The message
    says what it waits for and is safe to show to the client."""


class EmbeddingsLost(RuntimeError):
    """The encoder replica holding some of a request's media items died before their embeddings
    reached the LLM replica. `items` are the positions of those items in the request (the order of
    its embedding handles); the router re-encodes them on a live encoder and resubmits."""

    def __init__(self, items: tuple[int, ...], message: str = "an encoder replica was lost"):
        super().__init__(tuple(items), message)
        self.items = tuple(items)

    def __str__(self) -> str:
        return f"{self.args[1]} ({len(self.items)} media items to re-encode)"


_SYMBOLS_PANIC = "grammar.symbols.len()"  # llguidance's u16 symbol table overflowed


def grammar_engine_problem(error: str) -> str:
    """What the grammar engine (llguidance) found wrong with a grammar, as a sentence a client may
    read: its message on one line, or for a panic (an internal assertion, with a backtrace) what
    it means, never the panic's own text."""
    if _SYMBOLS_PANIC in error:
        return ("it is too large for the grammar engine (over 65,535 grammar symbols): use fewer or smaller "
                "schemas (fewer properties, enum values or tools)")
    if error.lstrip().startswith("panic") or "<backtrace>" in error:
        return "the grammar engine cannot compile it (an internal limit was hit): simplify the schema"
    return " ".join(error.split())[:300]
