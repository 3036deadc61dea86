"""A request on its way through the app, independent of the API it came in by (HTTP or gRPC)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import NamedTuple

from llm_service.sampling import Grammar, SamplingParams
from mmserve.errors import InvalidRequest
from mmserve.request.detokenize import IncrementalDetokenizer
from mmserve.request.prompt_plan import RequestPlan
from mmserve.request.tool_stream import ToolText
from mmserve.request.tools import JSON_FORMAT, ToolCall, answer
from mmserve.settings import check_fields, setting

logger = logging.getLogger("ray.serve")


def client_request_id(given: str | None, request_id: str) -> str:
    """The id shown to the client (response header / trailing metadata): its own request id when
    it sent one (logged beside ours), else ours. Only our id keys the request in the engine and
    encoders, so two clients may send the same one."""
    given = "".join(c for c in (given or "")[:128] if c.isascii() and c.isprintable())
    if not given:
        return request_id
    logger.info("request %s: client request id %r", request_id, given)
    return given


# Accepted ranges (vLLM's / OpenAI's), checked once for HTTP and gRPC alike.
MAX_INT32 = 2**31 - 1
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_SCHEMA_CHARS = 65536  # a response_format's JSON Schema, as text
MAX_N = 16


@dataclass(frozen=True)
class GenerationOptions:
    """What the client asked for; None means the model's default (vLLM semantics). The sampling
    options are declared here once, with their bounds (`mmserve.settings`; checked when made) and
    their names in the API where those differ (`top_logprobs`): the HTTP body takes them from here
    (`openai_models`), the gRPC request's `SamplingParams` passes its fields by these names, and
    `sampling_params` resolves them into the engine's."""

    max_tokens: int | None = setting(None, ge=1)
    temperature: float | None = setting(None, ge=0.0, le=2.0)
    top_p: float | None = setting(None, gt=0.0, le=1.0)
    top_k: int | None = setting(None, ge=-1, le=MAX_INT32)  # -1 and 0 disable it
    min_p: float | None = setting(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = setting(None, gt=0.0)
    frequency_penalty: float | None = setting(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = setting(None, ge=-2.0, le=2.0)
    seed: int | None = setting(None, ge=-(2**63), le=2**63 - 1)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # most likely alternatives to return per token; None: no logprobs
    logprobs: int | None = setting(None, name="top_logprobs", ge=0, le=MAX_LOGPROBS)
    response_format: Grammar | None = None  # None: plain text
    n: int = setting(1, ge=1, le=MAX_N)  # choices of the same prompt

    def __post_init__(self):
        """InvalidRequest naming the first option out of range (None means the default: fine)."""
        check_fields(self, InvalidRequest)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop has {len(self.stop)} strings; the limit is {MAX_STOP_STRINGS}")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequest(f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"stop_token_ids has {len(self.stop_token_ids)} ids; "
                                 f"the limit is {MAX_STOP_TOKEN_IDS}")
        for token_id in self.stop_token_ids:
            if not 0 <= token_id <= MAX_INT32:
                raise InvalidRequest(f"stop_token_ids must be in [0, {MAX_INT32}], got {token_id}")
        if self.response_format is not None and len(self.response_format.schema) > MAX_SCHEMA_CHARS:
            raise InvalidRequest(f"response_format's JSON schema has {len(self.response_format.schema)} characters; "
                                 f"the limit is {MAX_SCHEMA_CHARS}")


# The options both APIs pass as they are, by their names in the API (each spells `stop` and
# `response_format` its own way)
SAMPLING_OPTIONS = tuple(f for f in dataclasses.fields(GenerationOptions) if f.name not in ("stop", "response_format"))


def response_format(kind: str, schema: str | None = None) -> Grammar | None:
    """The grammar of an OpenAI `response_format` type (`text`: none), the same for HTTP and gRPC;
    `schema`: the JSON Schema's text (`json_schema` only)."""
    if kind in ("", "text"):
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind != "json_schema":
        raise InvalidRequest(f"response_format type must be text, json_object or json_schema; got {kind!r}")
    if not schema:
        raise InvalidRequest("response_format json_schema needs its schema")
    return Grammar("json_schema", schema)


def sampling_params(opts: GenerationOptions, prompt_len: int, max_model_len: int, defaults) -> SamplingParams:
    """What the engine samples with: the client's options, the checkpoint's `GenerationConfig`
    (`defaults`) for what it left out (vLLM's rule), `max_tokens` defaulting to the rest of the
    context; InvalidRequest when the prompt and `max_tokens` do not fit `max_model_len`."""
    remaining = max_model_len - prompt_len
    if remaining <= 0 or (opts.max_tokens is not None and opts.max_tokens > remaining):
        raise InvalidRequest(
            f"prompt of {prompt_len} tokens + max_tokens {opts.max_tokens or 1} exceeds the model's "
            f"context of {max_model_len} tokens"
        )
    sample = bool(defaults.do_sample)  # the checkpoint's sampling defaults apply only when it samples

    def default(value, model_value, greedy_value):
        if value is not None:
            return value
        return model_value if sample and model_value is not None else greedy_value

    return SamplingParams(
        max_tokens=opts.max_tokens or remaining,
        temperature=float(default(opts.temperature, defaults.temperature, 0.0)),
        top_p=float(default(opts.top_p, defaults.top_p, 1.0)),
        top_k=max(int(default(opts.top_k, defaults.top_k, 0)), 0),
        min_p=float(default(opts.min_p, getattr(defaults, "min_p", None), 0.0)),
        # like transformers' generate and vLLM, the checkpoint's repetition penalty applies greedy too
        repetition_penalty=float(opts.repetition_penalty or defaults.repetition_penalty or 1.0),
        frequency_penalty=float(opts.frequency_penalty or 0.0),
        presence_penalty=float(opts.presence_penalty or 0.0),
        seed=opts.seed,
        stop_token_ids=frozenset(opts.stop_token_ids),
        ignore_eos=opts.ignore_eos,
        logprobs=opts.logprobs,
        grammar=opts.response_format,
    )


class Delta(NamedTuple):
    text: str
    token_id: int | None
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    index: int = 0  # the choice


class Generation:
    """A validated, dispatched request and its token stream (first event already received)."""

    def __init__(self, request_id: str, plan: RequestPlan, sampling: SamplingParams, stop: tuple[str, ...],
                 stream, first, tokenizer, resume=None, router_ms: float | None = None, n: int = 1):
        self.request_id = request_id
        self.plan = plan
        self.sampling = sampling
        self.n = n
        self.first_token_at = time.perf_counter()  # made when the first token is back
        self.num_generated = 0
        self.tools: tuple = ()  # `ToolSpec`s whose calls the API parses out of the text (tool_choice not none)
        self.parallel_tool_calls = True  # False: the API keeps a choice's first call only
        self.tool_format = JSON_FORMAT  # the family's call form (`RequestPlanner.tool_format`)
        self.forced_tool_calls = False  # a grammar holds the text to calls (tool_choice required or a function)
        self._stop = stop
        self._stream = stream
        self._first = first
        self._tokenizer = tokenizer
        # `await resume(error, tokens sent)` -> (stream, first event) of a continuation on another
        # LLM replica, or re-raises (`deployments.core.failover.Failover.resume`); None: no failover
        self._resume = resume
        # milliseconds per stage (usage.stage_ms when asked): the router's, then the LLM's
        self.stages: dict[str, float] = {} if router_ms is None else {"router_ms": router_ms}
        self.report_stages = False

    async def _events(self) -> AsyncIterator:
        """The LLM's events, one uninterrupted stream across failovers (for `n` > 1 once tokens were
        sent, each unfinished choice resumes from its own: `failover.ChoiceStreams`)."""
        sent: dict[int, list[int]] = {i: [] for i in range(self.n)}
        ended: set[int] = set()
        event = self._first
        while True:
            if event is None:
                try:
                    event = await self._stream.__anext__()
                except StopAsyncIteration:
                    return
                except Exception as e:
                    if self._resume is None:
                        raise
                    self._stream.cancel()
                    by_choice = self.n > 1 and any(sent.values())  # each unfinished choice resumes on its own
                    left = {i: tuple(t) for i, t in sent.items() if i not in ended} if by_choice else tuple(sent[0])
                    self._stream, event = await self._resume(e, left)
            if event.token_id is not None:
                sent[event.choice].append(event.token_id)
            if event.finish_reason and event.stages:  # the last choice's end
                self.stages.update(event.stages)
            yield event
            if event.finish_reason is not None:
                ended.add(event.choice)
            if len(ended) == self.n:
                return
            event = None

    async def deltas(self) -> AsyncIterator[Delta]:
        """Text deltas of every choice (`Delta.index`), interleaved as they come; a stop string ends
        its choice (the LLM request is aborted once every choice has ended)."""
        detoks = [IncrementalDetokenizer(self._tokenizer, self._stop, self.tool_format.markers() if self.tools else None)
                  for _ in range(self.n)]
        running = set(range(self.n))
        try:
            async for event in self._events():
                i = event.choice
                if i not in running:  # ended by a stop string; its sequence runs on to its end
                    continue
                self.num_generated += event.token_id is not None
                detok = detoks[i]
                delta = detok.add(event.token_id) if event.token_id is not None else ""
                finish = "stop" if detok.stopped else event.finish_reason
                text = delta + detok.flush() if finish and not detok.stopped else delta
                yield Delta(text, event.token_id, finish, event.logprob, event.top_logprobs, i)
                if finish:
                    running.discard(i)
                    if not running:
                        return
        finally:
            self._stream.cancel()

    async def choices(self) -> list[tuple[str, str | None, list[Delta]]]:
        """Every choice's (text, finish reason, deltas), once the last has ended."""
        deltas: list[list[Delta]] = [[] for _ in range(self.n)]
        async for delta in self.deltas():
            deltas[delta.index].append(delta)
        return [("".join(d.text for d in ds), ds[-1].finish_reason if ds else None, ds) for ds in deltas]

    def answer(self, text: str, finish: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, tool calls, finish reason) of a choice's text (`mmserve.request.tools.answer`)."""
        return answer(text, finish, self.tools, self.parallel_tool_calls, self.tool_format, self.forced_tool_calls)

    async def tool_deltas(self) -> AsyncIterator[tuple[Delta, list[tuple] | None, list[ToolCall]]]:
        """`deltas()`, each with its `ToolText` events when the request has tools (else None) and, at
        its choice's end, the choice's calls: the streamed answer is the unstreamed one."""
        texts = [ToolText(self.tools, self.parallel_tool_calls, self.tool_format, self.forced_tool_calls)
                 for _ in range(self.n)] if self.tools else None
        async with contextlib.aclosing(self.deltas()) as deltas:
            async for delta in deltas:
                events, calls = None, []
                if texts is not None:
                    events = texts[delta.index].add(delta.text)
                    if delta.finish_reason:
                        more, calls = texts[delta.index].end()
                        events += more
                yield delta, events, calls

    def token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def usage(self) -> dict:
        prompt = len(self.plan.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.num_generated,
            "total_tokens": prompt + self.num_generated,
            "prompt_tokens_details": {"media_tokens": self.plan.num_media_tokens},
            **({"stage_ms": {k: round(v, 3) for k, v in self.stages.items()}} if self.report_stages else {}),
        }

    @property
    def time_per_output_token_ms(self) -> float | None:
        """Mean time per token after the first (TTFT excluded); None below two tokens."""
        n = self.num_generated
        return None if n < 2 else (time.perf_counter() - self.first_token_at) * 1000 / (n - 1)
