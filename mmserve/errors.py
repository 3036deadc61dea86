"""Errors that cross process boundaries with a meaning callers can act on."""


class InvalidRequest(ValueError):
    """The request (or one of its media items) is invalid: HTTP 400 / gRPC INVALID_ARGUMENT.

    The message names the problem and is safe to show to the client.
    """
