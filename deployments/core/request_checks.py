"""The Router's costly work on a request (tool schemas, the grammar the LLM replica will compile, the
prompt) off its event loop on `CheckPool`s, each job refused past `limits.check_timeout_s` naming its
step, the grammar's compile within the LLM replica's deadline and words, every character counted against
`max_prompt_chars` first: docs/security.md#costly-work-on-a-request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from llm_service.grammar import compile_matcher, compile_too_slow
from llm_service.sampling import Grammar
from mmserve.errors import InvalidRequest, QueueFull
from mmserve.request.prompt_plan import RequestPlan, RequestPlanner, prompt_chars
from mmserve.request.tools import check_tools

T = TypeVar("T")


class _Abandoned(Exception):
    """The caller stopped waiting: the job ends at its next step."""


class Step:
    """Where a job is (`what`: named when it is refused past the deadline)."""

    def __init__(self):
        self.what = "the request"
        self.abandoned = False

    def at(self, what: str) -> None:
        if self.abandoned:
            raise _Abandoned()
        self.what = what


class CheckPool:
    """Jobs on `threads` threads of their own. A job that waited `timeout_s` for a thread is
    refused with QueueFull (429: the pool was busy with others' jobs, not the request's fault), one
    that ran past its deadline with InvalidRequest (400) naming its step; its thread runs on to the
    job's next step (a native check cannot be interrupted)."""

    def __init__(self, name: str, threads: int, timeout_s: float):
        self.name, self.threads, self.timeout_s = name, threads, timeout_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"router-{name.replace(' ', '-')}")

    async def run(self, job: Callable[..., T], *args, timeout_s: float | None = None,
                  too_slow: Callable[[], Exception] | None = None) -> T:
        """`job(step, *args)` on the pool, running at most `timeout_s` (default: the pool's), refused
        past it with `too_slow()` when given."""
        loop, started, step = asyncio.get_running_loop(), asyncio.Event(), Step()

        def run() -> T:
            with contextlib.suppress(RuntimeError):  # the caller's loop is gone: it stopped waiting
                loop.call_soon_threadsafe(started.set)
            return job(step, *args)

        future = self._pool.submit(run)
        try:
            async with asyncio.timeout(self.timeout_s):
                await started.wait()
        except TimeoutError:
            step.abandoned = True
            future.cancel()  # not started yet: never runs
            raise QueueFull(f"the router's {self.name} are busy ({self.threads} threads)") from None
        timeout_s = timeout_s or self.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.wrap_future(future)
        except TimeoutError:
            step.abandoned = True
            if too_slow is not None:
                raise too_slow() from None
            raise InvalidRequest(f"{step.what} took longer than {timeout_s:g} s to check; simplify it") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestChecks:
    """The costly checks of one request (`check`) and its plan (`plan`), each on a `CheckPool` of
    `threads` threads. The grammar a request makes the LLM replica compile is compiled here the
    same way (`llm_service.grammar.compile_matcher`, with this model's tokenizer), so that what the
    Router accepts the LLM replica compiles (a schema overflowing the grammar engine's symbol
    table passed llguidance's validation, which skips that step, and failed on the LLM)."""

    def __init__(self, planner: RequestPlanner, threads: int, timeout_s: float, compile_timeout_s: float):
        self.planner, self.compile_timeout_s = planner, compile_timeout_s
        self.schemas = CheckPool("schema checks", threads, timeout_s)
        self.prompts = CheckPool("prompt plans", threads, timeout_s)
        self._grammar_tokenizer = None  # llguidance's view of the tokenizer (made once, ~2 s at Qwen's size)
        self._lock = threading.Lock()

    def grammar_tokenizer(self):
        with self._lock:
            if self._grammar_tokenizer is None:
                import llguidance.hf

                self._grammar_tokenizer = llguidance.hf.from_tokenizer(self.planner.tokenizer)
            return self._grammar_tokenizer

    async def check(self, request) -> Grammar | None:
        """Check a `request_core.ChatRequest` (its size, tools and calls, the grammar it makes the LLM
        compile); the grammar (a forced call's or `response_format`'s) or None. Without tools or a
        grammar nothing of it is costly (its text is counted, its calls' arguments within that count
        parsed): checked at once, never queued behind others' schemas."""
        if not request.tools and request.options.response_format is None:
            return self._check(Step(), request)
        grammar = await self.schemas.run(self._check, request)
        if grammar is not None:  # within the LLM replica's compile deadline, refused in its words
            if problem := await self.schemas.run(self._compile, grammar, timeout_s=self.compile_timeout_s,
                                                 too_slow=lambda: compile_too_slow(grammar, self.compile_timeout_s)):
                raise InvalidRequest(problem)
        return grammar

    async def plan(self, messages, tools) -> RequestPlan:
        return await self.prompts.run(self._plan, messages, tools)

    def _check(self, step: Step, request) -> Grammar | None:
        response_format = request.options.response_format
        self.planner.check_chars(prompt_chars(request.messages, request.tools)
                                 + (len(response_format.schema) if response_format else 0))
        check_tools(request.tools, step.at)
        step.at("the conversation's tool calls")
        self.planner.check_tools(request.messages)
        grammar = request.tool_grammar(self.planner.tool_format) or response_format
        if grammar is not None:
            step.at("the model's tokenizer for grammars")
            self.grammar_tokenizer()  # made once, outside the compile deadline
        return grammar

    def _compile(self, step: Step, grammar: Grammar) -> str | None:
        return _grammar_problem(self.grammar_tokenizer(), grammar)

    def _plan(self, step: Step, messages, tools) -> RequestPlan:
        step.at("the prompt (its chat template and tokens)")
        return self.planner.plan(messages, tools)


@functools.lru_cache(maxsize=64)  # keyed by the grammar's text: at most max_prompt_chars each
def _grammar_problem(tokenizer, grammar: Grammar) -> str | None:
    """Why the LLM replica would refuse to compile `grammar` (None: it compiles), remembered per grammar."""
    try:
        compile_matcher(tokenizer, grammar)
    except InvalidRequest as e:
        return str(e)
    return None
