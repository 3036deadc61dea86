"""In-process fakes of the request core's injected parts (`MediaDispatcher`, `LLMClient`, a backend
the readiness watch asks), and a core built on a real tiny checkpoint with them: the request path
without Ray."""

from __future__ import annotations

import asyncio

from ray import exceptions as ray_exceptions

from deployments.config import AppArgs, LimitArgs
from deployments.core.dispatch import MediaDispatcher
from deployments.core.llm_inputs import LocalMedia, PendingRequest
from deployments.core.readiness import Readiness
from deployments.core.request_core import RequestCore
from llm_service.engine.sequence import TokenEvent


def next_token(context: tuple[int, ...], seed: int = 0) -> int:
    """A deterministic 'model': the next token depends on the whole context (prompt + generated)
    and the sequence's seed (a request's choice i samples with its seed + i)."""
    return 100 + ((sum((i + 1) * t for i, t in enumerate(context)) + 7919 * seed) * 31) % 400


class FakeStream:
    def __init__(self, events):
        self._events = events
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        try:
            item = next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class FakeLLM:
    """An `LLMClient` whose i-th submission's replica dies after `die_after[i]` tokens (None: never),
    a request's `n` choices' tokens interleaved (each choice seeded with the request's seed + its index)."""

    def __init__(self, die_after: list[int | None] = (), error: type[BaseException] = ray_exceptions.ActorDiedError):
        self.die_after = list(die_after)
        self.error = error
        self.calls: list[PendingRequest] = []

    def generate(self, pending: PendingRequest) -> FakeStream:
        self.calls.append(pending)
        die = self.die_after.pop(0) if self.die_after else None

        def events():
            contexts = [list(pending.prompt_token_ids) for _ in range(pending.n)]
            seed, sent = pending.sampling.seed or 0, 0
            for n in range(pending.sampling.max_tokens):
                for choice, context in enumerate(contexts):
                    if die is not None and sent == die:
                        yield self.error()
                        return
                    context.append(next_token(tuple(context), seed + choice))
                    sent += 1
                    last = n + 1 == pending.sampling.max_tokens
                    yield TokenEvent(context[-1], "length" if last else None, choice=choice)

        return FakeStream(events())


class FakeDispatcher(MediaDispatcher):
    """Records every dispatch; hands each item back as it is (`LocalMedia`)."""

    def __init__(self):
        self.dispatched: list[list] = []

    async def dispatch(self, media):
        self.dispatched.append(list(media))
        return tuple(LocalMedia(m) for m in media)


class FakeBackend:
    """A deployment handle as the readiness watch calls it (`handle.ready.remote()`): a call waits
    until `start_replica()`, as a handle call waits for a replica whose constructor has not
    returned; the first `fail_first` calls fail instead (a replica lost mid-call)."""

    def __init__(self, fail_first: int = 0):
        self.ready = self  # `backend.ready.remote`, as on a handle
        self.calls = 0
        self.fail_first = fail_first
        self._up = asyncio.Event()

    def start_replica(self) -> None:
        self._up.set()

    def remote(self):
        self.calls += 1
        return self._answer(self.calls)

    async def _answer(self, call: int) -> bool:
        if call <= self.fail_first:
            raise ray_exceptions.ActorDiedError()
        await self._up.wait()
        return True


def make_core(model_dir: str, llm: FakeLLM | None = None, media: MediaDispatcher | None = None,
              limits: LimitArgs | None = None, readiness: Readiness | None = None, **args) -> RequestCore:
    """`args`: `AppArgs` fields (api_key, max_pending_requests ...)."""
    args = AppArgs(model=model_dir, served_model_name="m", limits=limits or LimitArgs(), **args).on_node()
    return RequestCore.from_checkpoint(args, media or FakeDispatcher(), llm or FakeLLM(), readiness=readiness)


def reader(request):
    """`RequestCore.generate`'s `read` for an already converted `ChatRequest`."""

    async def read():
        return request

    return read
