"""The request core: one request's way through the app, whatever API it came in by, without Ray.

`RequestCore.generate` is the whole flow: authenticate, admit, read the request (an HTTP body is
read only once admitted), check it against every limit (this module, `request_checks` and
`MediaLimits` are the only places limits are checked; the costly checks off the event loop), load
its media, plan the prompt (off the loop too), admit its work (`admission`), resolve sampling,
dispatch the media without waiting, and start the LLM stream with failover; it returns once the
first token (or the first error) is back. The HTTP and gRPC adapters (`openai_api`, `grpc_api`)
convert their wire format to a `ChatRequest` and a `Generation` back, and map `failures.classify`
to status codes.
The Serve deployment (`router.Router`) composes them with the two injected parts: a
`MediaDispatcher` and an `LLMClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import math
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from deployments.config import CHARS_PER_TOKEN, AppArgs
from mmserve.routing.affinity import prefix_hashes
from deployments.core.admission import Admission, Ticket
from deployments.core.dispatch import MediaDispatcher
from deployments.core.failover import Failover, LLMClient
from deployments.core.failures import Failure, classify
from deployments.core.generation import Generation, GenerationOptions, sampling_params
from deployments.core.llm_inputs import EmbeddingHandle, PendingRequest, StreamedVideo
from deployments.core.readiness import Readiness
from deployments.core.request_checks import RequestChecks
from deployments.media.fetch import MediaFetcher
from llm_service.engine.sequence import LoraRequest
from llm_service.sampling import Grammar
from llm_service.model.quantized import read_format
from mmserve.errors import InvalidRequest, NotReady, QueueFull, RequestTooLarge, ShuttingDown, Unauthenticated
from mmserve.inputs.media import AdapterRef, DecodedVideo, EncodeItem, MediaItem, MediaSource, warm_up_image
from mmserve.lora import tower_media
from mmserve.request.prompt_plan import Message, RequestPlanner
from mmserve.request.tools import ToolFormat, ToolSpec, check_tool_results
from mmserve.video.container import VideoSampling

logger = logging.getLogger("ray.serve")
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatRequest:
    """A request as every API gives it to the core: messages whose media are not loaded yet."""

    messages: tuple[Message[MediaSource], ...]
    options: GenerationOptions
    model: str | None = None  # when set, it must name the served model or one of its LoRA adapters
    tools: tuple[ToolSpec, ...] = ()
    # "none" (tools not shown), "auto" (the model may call), "required" (it must), or the one
    # function's name it must call
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    video_sampling: VideoSampling | None = None  # of its video files (`mm_processor_kwargs`); None: the model's

    def tool_grammar(self, fmt: ToolFormat) -> Grammar | None:
        """The grammar forcing a call (`required` or a named function) in the family's form
        (`RequestPlanner.tool_format`), None otherwise."""
        if not self.tools or self.tool_choice in ("none", "auto"):
            return None
        tools = self.tools
        if self.tool_choice != "required":
            if not (tools := tuple(t for t in self.tools if t.name == self.tool_choice)):
                raise InvalidRequest(f"tool_choice names {self.tool_choice!r}, which is not among the tools")
        if self.options.response_format is not None:
            raise InvalidRequest("response_format and a forced tool_choice cannot be combined")
        return Grammar("lark", fmt.grammar(list(tools), self.parallel_tool_calls))


class VideoDecoding(Protocol):
    """Video files to their sampled frames: the VideoDecoder deployment's client, or a
    `mmserve.video.workers.VideoDecodePool` in-process."""

    async def decode(self, data: bytes, request_id: str, sampling: VideoSampling | None = None) -> DecodedVideo: ...

    async def probe(self, data: bytes, request_id: str, sampling: VideoSampling | None = None,
                    decode_below: int = 0) -> DecodedVideo:
        """The video's header (no pixels): what to plan a streamed video with; decoded whole (its
        pixels) when it samples to fewer than `decode_below` frames, in the same call."""


class RequestListener:
    """What the core reports (metrics): a request ended ("ok" or a `failures.Kind`), got its first
    token, sent its last, was resubmitted after a lost replica, had items re-encoded. No-ops here."""

    def on_outcome(self, outcome: str) -> None: ...
    def on_started(self, gen: Generation, ttft_ms: float, num_media: int) -> None: ...
    def on_finished(self, gen: Generation) -> None: ...
    def on_resubmit(self, continuation: PendingRequest) -> None: ...
    def on_reencode(self, num_items: int) -> None: ...


class Bound:
    """`limit` places; `take()` holds one for a `with` block. QueueFull (429) when none is free."""

    def __init__(self, limit: int, what: str):
        self.limit, self.what, self.held = limit, what, 0

    def check(self) -> None:
        if self.held >= self.limit:
            raise QueueFull(f"{self.held} {self.what} (limit {self.limit})")

    @contextlib.contextmanager
    def take(self):
        self.check()
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1


def new_request_id() -> str:
    """Our id of a request: the engine's and encoders' key (a client's own id is only shown)."""
    return uuid.uuid4().hex


class RequestCore:
    def __init__(self, args: AppArgs, planner: RequestPlanner, generation_defaults,
                 media: MediaDispatcher, llm: LLMClient, listener: RequestListener | None = None,
                 draining: Callable[[], bool] = lambda: False, videos: VideoDecoding | None = None,
                 readiness: Readiness | None = None):
        """`args` as the builder completed them (`served_model_name` set) and the Router resolved them
        on its node (`AppArgs.on_node`: `engine.max_model_len` is the context served)."""
        self.args, self.limits, self.max_model_len = args, args.limits, args.engine.max_model_len
        self.planner = planner
        self.tokenizer = planner.tokenizer
        self.generation_defaults = generation_defaults  # transformers GenerationConfig of the checkpoint
        self.media = media
        self.llm = llm
        self.listener = listener or RequestListener()
        self._draining = draining
        self.videos = videos
        self.readiness = readiness or Readiness({})  # none given: ready from the start
        self.pending = Admission(args.max_pending_requests, args.ttft_budget_s)
        self.checks = RequestChecks(planner, args.limits.check_threads, args.limits.check_timeout_s,
                                    args.engine.grammar_compile_timeout_s)
        self.receiving = Bound(args.max_fetching_requests, "requests are being received (body, media)")
        self.created = int(time.time())
        fmt = read_format(args.model)  # the language model's weights as the checkpoint stores them
        self.quantization = fmt.name if fmt else None

    @classmethod
    def from_checkpoint(cls, args: AppArgs, media: MediaDispatcher, llm: LLMClient,
                        listener: RequestListener | None = None, draining=lambda: False,
                        videos: VideoDecoding | None = None, readiness: Readiness | None = None) -> RequestCore:
        from transformers import AutoTokenizer, GenerationConfig

        model_dir, limits, max_model_len = args.model, args.limits, args.engine.max_model_len
        planner = RequestPlanner(model_dir, AutoTokenizer.from_pretrained(model_dir), limits.media_limits(),
                                 limits.max_prompt_chars or CHARS_PER_TOKEN * max_model_len, max_model_len)
        try:
            defaults = GenerationConfig.from_pretrained(model_dir)
        except OSError:
            defaults = GenerationConfig()
        return cls(args, planner, defaults, media, llm, listener, draining, videos, readiness)

    # -- the request flow ---------------------------------------------------------------------
    async def generate(self, authorization: str | None, read: Callable[[], Awaitable[ChatRequest]],
                       request_id: str, client: str = "") -> Generation:
        """Authenticate, `read()` the request, check it and load its media, then admit, plan,
        dispatch and start it. Before the app is ready a request waits up to `readiness_wait_s`, then
        gets `NotReady`: long enough to cover a Router replica that just started in a running app, short
        enough that a client of an app still loading its models is told so instead of waiting it out.
        The two admission bounds (`max_fetching_requests` while receiving; `Admission` from planning to
        the first token, `client` its address): docs/architecture.md step 2, docs/operations.md#admission.

        Raises the typed errors `failures.classify` maps: `Unauthenticated` before anything else,
        `ShuttingDown` / `QueueFull` / `NotReady` before the request is read, `InvalidRequest` for anything
        the client got wrong, and whatever a backend raised."""
        received = time.perf_counter()
        self.authenticate(authorization)
        self._check_open(client)
        with self.receiving.take():
            if not await self.readiness.wait(self.args.readiness_wait_s):
                raise NotReady(self.readiness.reason())
            request = await read()
            self._check(request)
            grammar = await self.checks.check(request)  # off the loop: schemas, the grammar, the size
            messages = await self._load_media(request, request_id)
        self._check_open(client, request.options.n)
        with self.pending.take(client, request.options.n) as ticket:
            return await self._start(messages, request, grammar, request_id, received, ticket)

    def authenticate(self, authorization: str | None) -> None:
        """`authorization` is the HTTP header / gRPC metadata value: "Bearer KEY" when a key is set."""
        key = self.args.api_key
        if key and not hmac.compare_digest((authorization or "").encode(), f"Bearer {key}".encode()):
            raise Unauthenticated("invalid or missing API key (send 'Authorization: Bearer KEY')")

    def check_size(self, num_bytes: int) -> None:
        if num_bytes > (limit := self.limits.max_request_bytes):
            raise RequestTooLarge(f"request body exceeds the limit of {limit} bytes")

    def not_ready(self) -> str | None:
        """What the app still waits for (`Readiness.reason`), or None once it is ready."""
        self.readiness.start()
        return self.readiness.reason() or None

    def unavailable(self) -> str | None:
        """Why this replica takes no new requests now (draining, or not ready yet), or None: what
        `/health` and gRPC health answer."""
        return "server is shutting down" if self._draining() else self.not_ready()

    def warm_up(self) -> None:
        """Plan one small request with an image, so that the first client's plan finds the chat
        template compiled and image header reading loaded (their first use costs ~10 ms)."""
        self.planner.plan([Message("user", ("Describe this image.", warm_up_image()))])

    def _check_open(self, client: str, sequences: int = 1) -> None:
        """503 while draining, 429 while no place is free for `client`'s `sequences` (`Admission`)."""
        if self._draining():
            raise ShuttingDown("server is shutting down")
        self.pending.check(client, sequences)

    def _check(self, request: ChatRequest) -> None:
        name = self.args.served_model_name
        if request.model and request.model != name and request.model not in self.args.lora_modules:
            names = ", ".join(repr(n) for n in (name, *self.args.lora_modules))
            raise InvalidRequest(f"model {request.model!r} is not served here; use {names}")
        if not request.messages:
            raise InvalidRequest("messages: at least one message is required")
        for i, message in enumerate(request.messages):
            if message.role not in ROLES:
                raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {message.role!r}")
        check_tool_results(request.messages)
        self.planner.limits.check(media_of(request.messages))  # counts, before anything is fetched
        if request.video_sampling is not None:
            request.video_sampling.check(self.limits.max_frames_per_video)

    async def _load_media(self, request: ChatRequest, request_id: str) -> list[Message[MediaItem]]:
        """The messages with every media source loaded: all URLs of the request fetched at once,
        under one deadline and one byte budget (`media_fetch`), then every video file decoded to
        its sampled frames (the VideoDecoder deployment), all at once."""
        sources = media_of(request.messages)
        urls = [f for source in sources for f in source.frames if isinstance(f, str)]
        fetched = iter(await MediaFetcher(self.limits, request_id).load_all(urls) if urls else ())
        frames = [tuple(f if isinstance(f, bytes) else next(fetched) for f in source.frames) for source in sources]
        files = [i for i, source in enumerate(sources) if source.container]
        decoded, stream = {}, self.args.stream_video and self.planner.face.streams_video
        if files:
            if self.videos is None:
                raise InvalidRequest("this server does not decode video files; send a video as its frames")
            # streamed: planned from the header; the LLM replica decodes and encodes it (the file goes along).
            # Only where that pays: a video sampling to fewer than stream_min_frames is decoded whole, as
            # unstreamed (a lone one in the same call as its header). One video is bounded by its decoder
            # (max_decoded_pixels_per_video); several are read to their headers first and bounded together
            # before any is decoded
            sampling, min_frames = request.video_sampling, self.args.video_decode.stream_min_frames
            probe = functools.partial(self.videos.probe, decode_below=min_frames)
            read = self.videos.probe if len(files) > 1 else probe if stream else self.videos.decode
            decoded = dict(zip(files, await _all_or_none([read(frames[i][0], request_id, sampling) for i in files])))
            total = sum(math.prod(video.shape) for video in decoded.values()) if len(files) > 1 else 0
            if total > (limit := self.limits.max_decoded_pixels_per_request):
                raise InvalidRequest(
                    f"the request's {len(files)} videos sample to {total} decoded pixels together, over the limit "
                    f"of {limit} (max_decoded_pixels_per_request); send fewer, shorter or smaller videos")
            whole = [i for i in files if decoded[i].pixels is None and (not stream or decoded[i].shape[0] < min_frames)]
            if whole:
                decoded.update(zip(whole, await _all_or_none([self.videos.decode(frames[i][0], request_id, sampling)
                                                              for i in whole])))
        # a streamed video keeps its file (the LLM replica decodes it); a decoded one only its frames
        items = iter([MediaItem(source.kind, () if i in decoded and decoded[i].pixels is not None else frames[i],
                                fps=source.fps, decoded=decoded.get(i)) for i, source in enumerate(sources)])
        return [dataclasses.replace(m, parts=tuple(p if isinstance(p, str) else next(items) for p in m.parts))
                for m in request.messages]

    async def _start(self, messages: list[Message[MediaItem]], request: ChatRequest, grammar: Grammar | None,
                     request_id: str, received: float, ticket: Ticket) -> Generation:
        """`grammar`: `response_format`'s, or the one holding a forced call to the tools (checked)."""
        started = time.perf_counter()
        options = dataclasses.replace(request.options, response_format=grammar)
        tools = request.tools if request.tool_choice != "none" else ()
        plan = await self.checks.plan(messages, tools)
        self.pending.admit(ticket, len(plan.token_ids))
        sampling = sampling_params(options, len(plan.token_ids), self.max_model_len, self.generation_defaults)
        adapter = self.args.lora_modules.get(request.model or "")
        lora = LoraRequest(request.model, adapter) if adapter else None
        # under an adapter of the vision tower, each item carries it (its key too: `tower_media`)
        media = tower_media(plan.media, AdapterRef(lora.name, lora.path) if lora else None)
        pending = PendingRequest(
            request_id=request_id, prompt_token_ids=tuple(plan.token_ids), sampling=sampling,
            positions=plan.positions, ranges=tuple(plan.ranges), embeddings=await self._dispatch(media),
            prefix_hashes=prefix_hashes(plan.token_ids, plan.ranges, [item.content_hash for item in plan.items],
                                        self.args.engine.block_size, lora.name if lora else ""),
            snapshot_boundaries=plan.snapshot_boundaries,
            n=options.n, lora=lora,
        )
        logger.info("request %s: %d prompt tokens, %d media items (%d media tokens), max_tokens %d",
                    request_id, len(plan.token_ids), len(plan.items), plan.num_media_tokens, sampling.max_tokens)

        async def reencode(handles: tuple[EmbeddingHandle, ...], lost: tuple[int, ...]):
            self.listener.on_reencode(len(lost))
            redone = dict(zip(lost, await self._dispatch([media[i] for i in lost])))
            return tuple(redone.get(i, handle) for i, handle in enumerate(handles))

        failover = Failover(self.llm, pending, self.args.llm_retries, self.listener.on_resubmit, reencode)
        router_ms = (time.perf_counter() - received) * 1000  # read, fetch, plan, dispatch the media
        stream, first = await failover.start()  # errors surface here, before any response is sent
        if not failover.attempts:  # a lost replica's wait is no measure of the queue's pace
            self.pending.started(ticket)
        gen = Generation(request_id, plan, sampling, options.stop, stream, first, self.tokenizer, failover.resume,
                         router_ms, options.n)
        gen.tools, gen.parallel_tool_calls = tools, request.parallel_tool_calls
        gen.tool_format = self.planner.tool_format
        gen.forced_tool_calls = bool(tools) and request.tool_choice not in ("auto", "none")
        self.listener.on_started(gen, (time.perf_counter() - started) * 1000, len(media))
        return gen

    async def _dispatch(self, media: Sequence[EncodeItem]) -> tuple[EmbeddingHandle, ...]:
        """A handle per item: the dispatcher's, or for a streamed video its file and frame groups."""
        def streamed_video(m: EncodeItem) -> StreamedVideo:
            groups = self.planner.face.stream_groups(m.item, m.layout, self.args.video_decode.stream_group_frames)
            return StreamedVideo(m.item.frames[0], m.item.decoded, tuple(groups), tower_adapter=m.item.tower_adapter)

        streamed = {i: streamed_video(m) for i, m in enumerate(media)
                    if m.item.decoded is not None and m.item.decoded.pixels is None}
        rest = [m for i, m in enumerate(media) if i not in streamed]
        handles = iter(await self.media.dispatch(rest) if rest else ())
        return tuple(streamed[i] if i in streamed else next(handles) for i in range(len(media)))

    # -- outcomes -------------------------------------------------------------------------------
    def finished(self, gen: Generation) -> None:
        self.listener.on_finished(gen)
        self.listener.on_outcome("ok")

    def failed(self, e: BaseException, request_id: str) -> Failure:
        """How a failed request is answered (status and client-safe message), counted and logged."""
        failure = classify(e)
        self.listener.on_outcome(failure.kind)
        if failure.kind in ("invalid", "too_large", "unauthenticated"):
            logger.info("request %s rejected: %s", request_id, failure.message)
        elif failure.kind == "internal":
            logger.error("request %s failed: %r", request_id, e, exc_info=e)
        else:
            logger.warning("request %s failed (%s): %r", request_id, failure.kind, e)
        return failure

    def model_cards(self) -> list[dict]:
        """`GET /v1/models`'s entries: the served model, then each LoRA adapter (its `parent` the
        served model, as vLLM lists them)."""
        base = {"id": self.args.served_model_name, "object": "model", "created": self.created, "owned_by": "mmserve",
                "root": self.args.model, "parent": None, "max_model_len": self.max_model_len,
                "quantization": self.quantization}
        return [base] + [base | {"id": name, "root": path, "parent": base["id"]}
                         for name, path in self.args.lora_modules.items()]

    def check_health(self) -> None:
        if not self.tokenizer.encode("ok"):
            raise RuntimeError("the router's tokenizer returned no tokens")


async def _all_or_none(calls: list[Awaitable]) -> list:
    """The results of `calls`, run at once; the first failure cancels the others and is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def media_of(messages: Sequence[Message]) -> list:
    """The media parts of `messages`, in prompt order."""
    return [p for m in messages for p in m.parts if not isinstance(p, str)]
