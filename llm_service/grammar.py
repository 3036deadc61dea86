"""Structured outputs: a request's `Grammar` compiled for the served tokenizer, a matcher per
sequence, and each step's token mask applied to the constrained rows' logits (docs/api.md#structured-outputs).

The grammar engine is llguidance (`bench/grammar.py` measured it against xgrammar; xgrammar 0.2's
bounded strings also admit raw control characters, which no JSON parser takes). A grammar compiles
once per schema text, on `GrammarCompiler`'s threads, so the engine's step thread never compiles;
each sequence's matcher is a copy of the compiled grammar's (`CompiledGrammar`).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from cachetools import LRUCache

from llm_service.config import EngineConfig
from llm_service.model.transfer import ints
from llm_service.sampling import DeviceSample, Grammar
from mmserve.errors import InvalidRequest, grammar_engine_problem

COMPILE_TIMEOUT_S = EngineConfig.grammar_compile_timeout_s  # the engine passes its `grammar_compile_timeout_s`
ANY_OBJECT = '{"type": "object"}'  # `json_object`: a JSON object, as OpenAI's JSON mode
CACHE_SIZE = 128  # compiled grammars kept (LRU), keyed by kind and schema text
ROOT_COPIES = 1024  # matchers one root is copied to before a fresh root replaces it (`CompiledGrammar`)
COMPILE_THREADS = 4  # a compile past its deadline runs on (it cannot be interrupted): others keep a thread
COMPACT = {"whitespace_flexible": False}  # separators "," and ":", no whitespace between tokens
_STRING_RUN = '[^"\\\\\\x00-\\x1F\\x7F]'  # characters a JSON string holds unescaped
# llguidance's token slices, finer than its default runs (at most 10, 30, any): inside a string with a
# `maxLength`, every run that still fits is allowed whole instead of walked token by token. The masks
# are the same; on the 30-property invoice schema with Qwen's vocabulary a fill took 0.16 ms on average
# instead of 0.24 (2 CPU cores; the most expensive states, short strings near their bound, stay ~2 ms)
SLICES = ("[\\x20\\x0A\\x0D\\x09]+", *(f"{_STRING_RUN}{{1,{n}}}" for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)),
          f"{_STRING_RUN}+")
CANDIDATES = 32  # `StepMasks.correct`: a refused row's highest logits checked before its mask is filled
SPARSE_WORDS = 1024  # `StepMasks.correct`: a refused row with at most this many nonzero mask words reads only theirs


@dataclass
class GrammarStats:
    compiles: int = 0  # grammars compiled, and roots built for parallel fills (`CompiledGrammar`)
    cache_hits: int = 0
    compile_s: list[float] = field(default_factory=list)  # each compile's seconds, drained by metrics


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar of `grammar` (InvalidRequest for a JSON Schema that is not JSON)."""
    from llguidance import LLMatcher, grammar_from

    if grammar.kind == "lark":
        return grammar_from("lark", grammar.schema)
    try:
        return LLMatcher.grammar_from_json_schema(ANY_OBJECT if grammar.kind == "json_object" else grammar.schema,
                                                  defaults=COMPACT)
    except ValueError as e:
        raise InvalidRequest(f"response_format: the JSON schema is not valid JSON: {e}") from None


def compile_matcher(tokenizer, grammar: Grammar, text: str | None = None):
    """A matcher of `grammar` at its start, for `tokenizer` (an `LLTokenizer`): the whole compile
    (`text`: `grammar_text(grammar)` when already made), InvalidRequest naming what llguidance
    found wrong in a sentence (`grammar_engine_problem`). The Router checks a request's grammars
    with this too (`deployments.core.request_checks`), so that it accepts what the LLM compiles."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, grammar_text(grammar) if text is None else text, log_level=0)
    if matcher.is_error():
        raise InvalidRequest(f"{_subject(grammar)} cannot be compiled: {grammar_engine_problem(matcher.get_error())}")
    return matcher


def compile_too_slow(grammar: Grammar, timeout_s: float) -> InvalidRequest:
    """The refusal of a grammar past the compile deadline (the Router's check says the same)."""
    return InvalidRequest(f"{_subject(grammar)} took longer than {timeout_s:g} s to compile; simplify it (fewer "
                          "alternatives, smaller bounds)")


def _subject(grammar: Grammar) -> str:
    return "tools: the functions' JSON schemas" if grammar.kind == "lark" else "response_format: the JSON schema"


class GrammarCompiler:
    """Compiles `Grammar`s for one tokenizer and logits width (`vocab_size`: padding ids included,
    which the masks always forbid); the sequence ends at `stop_token_ids` once the grammar is
    complete. A compile past its deadline runs on (a native compile cannot be interrupted) and is
    cached when it ends. `max_roots`: `CompiledGrammar`."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = CACHE_SIZE,
                 timeout_s: float = COMPILE_TIMEOUT_S, max_roots: int = 1):
        import llguidance.hf
        import llguidance.torch  # noqa: F401  ~2 s on first import: here, not in the first constrained step

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_token_ids),
                                                      slices=list(SLICES))
        self._cache: LRUCache[Grammar, CompiledGrammar] = LRUCache(maxsize=cache_size)
        self._compiling: dict[Grammar, Future] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        # copies are cheap (microseconds, a resumed stream's prefix read): never queued behind compiles
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="grammar-matchers")
        self.cache_size, self.timeout_s, self.max_roots = cache_size, timeout_s, max_roots
        self.stats = GrammarStats()

    def _timed(self, build):
        start = time.perf_counter()
        try:
            return build()
        finally:
            self.stats.compiles += 1
            self.stats.compile_s.append(time.perf_counter() - start)

    def _compile(self, grammar: Grammar) -> CompiledGrammar:
        def build() -> CompiledGrammar:
            text = grammar_text(grammar)
            return CompiledGrammar(self.tokenizer, grammar, text, compile_matcher(self.tokenizer, grammar, text),
                                   self.max_roots)

        compiled = self._timed(build)
        with self._lock:
            self._cache[grammar] = compiled
        return compiled

    def submit(self, grammar: Grammar) -> Future:
        """A future of `grammar` compiled (done at once when cached); one compile per grammar at a time."""
        with self._lock:
            if (compiled := self._cache.get(grammar)) is not None:  # now the most recently used
                self.stats.cache_hits += 1
                done: Future = Future()
                done.set_result(compiled)
                return done
            if (running := self._compiling.get(grammar)) is not None:
                return running
            running = self._compiling[grammar] = Future()
        # started outside the lock: a compile that ends at once (a bad schema fails in microseconds)
        # settles its future on whichever thread runs it, and never under the lock this call held
        # (a done-callback added under it ran inline on a finished future and took the lock again)
        try:
            self._pool.submit(self._settle, grammar, running)
        except RuntimeError as e:  # shut down
            with self._lock:
                self._compiling.pop(grammar, None)
            running.set_exception(e)
        return running

    def _settle(self, grammar: Grammar, future: Future) -> None:
        """Compile `grammar` into `future` (a failure is retried by the next submit)."""
        try:
            result, error = self._compile(grammar), None
        except BaseException as e:  # noqa: BLE001  the caller's future carries it
            result, error = None, e
        with self._lock:
            self._compiling.pop(grammar, None)
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """The compiled grammar, waiting here (InvalidRequest: a bad schema, or over the deadline)."""
        try:
            return self.submit(grammar).result(timeout=self.timeout_s)
        except TimeoutError:
            raise compile_too_slow(grammar, self.timeout_s) from None

    async def matchers(self, grammar: Grammar, n: int, prefix: Sequence[int] = ()) -> list[Matcher]:
        """`n` matchers of `grammar` (the `n` choices of a request), each past `prefix` (a resumed
        stream's tokens): compiled and copied off the event loop, the new roots
        (`CompiledGrammar.claim_roots`) waited for at most half the time left (a later root serves
        later rows); the deadline covers it all (InvalidRequest past it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                compiled = await asyncio.wrap_future(self.submit(grammar))
            roots = [asyncio.wrap_future(self._pool.submit(self._grow, compiled))
                     for _ in range(compiled.claim_roots(n))]
            if roots:
                await asyncio.wait(roots, timeout=(deadline - loop.time()) / 2)
            async with asyncio.timeout_at(deadline):
                return await asyncio.wrap_future(self._copier.submit(self._copy, compiled, n, prefix))
        except TimeoutError:
            raise compile_too_slow(grammar, self.timeout_s) from None

    def copies(self, compiled: CompiledGrammar, n: int, prefix: Sequence[int] = ()) -> list[Matcher]:
        """As `matchers`, in this thread (the engine's own requests: tests, benches)."""
        for _ in range(compiled.claim_roots(n)):
            self._grow(compiled)
        return self._copy(compiled, n, prefix)

    @staticmethod
    def _copy(compiled: CompiledGrammar, n: int, prefix: Sequence[int]) -> list[Matcher]:
        return [Matcher(compiled, prefix) for _ in range(n)]

    def _grow(self, compiled: CompiledGrammar) -> None:
        root = None
        try:
            root = self._timed(lambda: compile_matcher(self.tokenizer, compiled.grammar, compiled.text))
        finally:
            compiled.add_root(root)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._copier.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Root:
    """An independent matcher at the start of its grammar, and the copies made of it."""

    matcher: object
    live: int = 0  # copies not dropped yet
    served: int = 0  # copies made

    @property
    def worn(self) -> bool:
        return self.served >= ROOT_COPIES


class CompiledGrammar:
    """A grammar compiled for one tokenizer, whose matchers are copies (`matcher`): a `deep_copy`
    takes microseconds where a compile takes ~2 ms to ~1.7 s, so no sequence compiles its schema.

    Copies of one matcher share its lexer behind a lock, so their masks fill one row at a time
    (64 rows: 23 ms a step on an H200's host). So the grammar keeps up to `max_roots` independent
    roots (each its own compile), built as the rows need them (`claim_roots`); a copy is made of
    the root with the fewest live copies. A root's lexer grows with what its copies read, so a
    root that made `ROOT_COPIES` copies is replaced by a fresh one."""

    def __init__(self, tokenizer, grammar: Grammar, text: str, root, max_roots: int = 1):
        self.tokenizer, self.grammar, self.text, self.max_roots = tokenizer, grammar, text, max_roots
        self._roots = [_Root(root)]
        self._lock = threading.Lock()
        self._building = 0  # roots claimed, being built

    @property
    def num_roots(self) -> int:
        return len(self._roots)

    def matcher(self) -> tuple[object, _Root]:
        """A new llguidance matcher at the grammar's start, and its root (to `release` with the copy)."""
        with self._lock:
            root = min(self._roots, key=lambda r: (r.worn, r.live))
            root.live += 1
            root.served += 1
        return root.matcher.deep_copy(), root

    def release(self, root: _Root) -> None:
        with self._lock:
            root.live -= 1

    def claim_roots(self, rows: int) -> int:
        """How many roots the caller is to build (then `add_root`) before copying `rows` new rows:
        one per row running or new, up to `max_roots`, worn roots not counted."""
        with self._lock:
            have = sum(not r.worn for r in self._roots) + self._building
            claimed = max(0, min(sum(r.live for r in self._roots) + rows, self.max_roots) - have)
            self._building += claimed
            return claimed

    def add_root(self, matcher) -> None:
        """A claimed root built (None: its build failed): it replaces a worn root, or joins the others."""
        with self._lock:
            self._building -= 1
            worn = next((i for i, r in enumerate(self._roots) if r.worn), None)
            if matcher is None:
                return
            if worn is not None:
                self._roots[worn] = _Root(matcher)
            elif len(self._roots) < self.max_roots:
                self._roots.append(_Root(matcher))


class Matcher:
    """One sequence's place in its grammar."""

    def __init__(self, compiled: CompiledGrammar, prefix: Sequence[int] = ()):
        self._m, root = compiled.matcher()
        weakref.finalize(self, compiled.release, root)
        # a stream resumed on another replica: the tokens it had sent
        if prefix and not self._m.consume_tokens(list(prefix)):
            raise InvalidRequest("the tokens already sent do not follow the response_format grammar")

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def takes(self, token: int) -> bool:
        """The parser takes `token` next (the mask's bit where the matcher is `free`); no move."""
        return self._m.validate_tokens([token]) == 1

    @property
    def free(self) -> bool:
        """Neither bytes forced next nor a stop token allowed: where the parser takes exactly the
        tokens the mask allows (with forced bytes the parser takes any split of them, the mask only
        their canonical tokens; a stop token the mask allows the parser does not take)."""
        return not self._m.compute_ff_bytes() and not self._m.is_accepting()

    @property
    def complete(self) -> bool:
        """Only a stop token may follow (or one was accepted)."""
        return self._m.is_stopped()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._m, bitmask, row)

    @staticmethod
    def fill_all(executor, matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(executor, [(m._m, j) for j, m in enumerate(matchers)], bitmask)


class StepMasks:
    """The token masks of one engine's constrained rows: a host bitmask (32 token ids per int32),
    filled per step for the constrained rows only, applied to those rows' logits on their device."""

    def __init__(self, vocab_size: int, threads: int | None = None):
        self.vocab_size = vocab_size
        self._host = _bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)
        self._table: torch.Tensor | None = None  # CPU logits: each byte's 8 values to add (0 or -inf)
        self._add: torch.Tensor | None = None  # CPU logits: the rows' values to add
        self._threads = threads  # default: torch's intra-op threads when the pool is made (the replica's share)
        self._executor = None  # llguidance's thread pool for many rows (made on first use)
        self.mask_s = 0.0  # seconds spent filling and applying masks, drained by metrics
        self.fill_s, self.fill_rows = 0.0, 0  # seconds spent filling rows, and how many (bench/llm.py --grammar)

    @property
    def threads(self) -> int:
        """The threads filling a step's rows (`GrammarCompiler.max_roots`)."""
        return self._threads or max(1, torch.get_num_threads())

    def fill(self, matchers: Sequence[Matcher]) -> torch.Tensor:
        """The host bitmask rows of `matchers`, in order (row j: the tokens `matchers[j]` allows next)."""
        start = time.perf_counter()
        if self._host.shape[0] < len(matchers):
            self._host = _bitmask(len(matchers), self.vocab_size)
        host = self._host[:len(matchers)]
        if len(matchers) == 1:
            matchers[0].fill(host, 0)
        else:  # each row ~0.5 ms at Qwen's vocabulary size: on a thread pool (it releases the GIL)
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor(num_threads=self.threads)
            Matcher.fill_all(self._executor, matchers, host)
        self.fill_s += time.perf_counter() - start
        self.fill_rows += len(matchers)
        return host

    def sample(self, logits: torch.Tensor, seqs, sample: Callable[[], DeviceSample],
               read_before: Callable[[], None]) -> DeviceSample:
        """`sample()` of `logits` `(N, V)`, where each constrained row of `seqs` keeps only the
        tokens its grammar allows next: masked before sampling (`apply`), or after it (`correct`)
        on CPU logits for the greedy rows that want neither logprobs nor penalties.

        With overlap a row's last token was sampled by the step launched before this one:
        `read_before` reads (and postprocesses) that step after this step's forward was launched,
        so the masks fill while it runs (a step without constrained rows waits for nothing); a row
        that finished there gets no mask. Reading it also means its mask's copy from the host
        buffer is done before the buffer is filled again."""
        if all(s.matcher is None for s in seqs):
            return sample()
        read_before()
        cpu = logits.device.type == "cpu"
        after, before = [], []
        for j, s in enumerate(seqs):
            if s.matcher is not None and not s.finished:
                p = s.request.sampling
                lazy = cpu and p.greedy and p.logprobs is None and not p.has_penalties
                (after if lazy else before).append((j, s.matcher))
        if before:
            self.apply(logits, before)
        result = sample()
        if after:
            self.correct(logits, result.token_ids, after)
        return result

    def apply(self, logits: torch.Tensor, matchers: Sequence[tuple[int, Matcher]]) -> None:
        """Mask `logits` `(N, V)` in place: row `i` of each `(i, matcher)` keeps what it allows."""
        start = time.perf_counter()
        host = self.fill([m for _, m in matchers])
        rows = [i for i, _ in matchers]
        device, vocab = logits.device, logits.shape[-1]
        at = None if rows == list(range(logits.shape[0])) else ints(rows, device)
        if device.type == "cpu":
            add = self._addends(host, logits.dtype)[:, :vocab]
            if at is None:
                logits.add_(add)
            else:
                logits.index_add_(0, at, add)
        else:  # copied from pinned memory (the host does not wait for the forward still running), applied in place
            from mmserve.kernels.triton_bitmask import apply_token_bitmask_

            apply_token_bitmask_(logits, host.to(device, non_blocking=True), at)
        self.mask_s += time.perf_counter() - start

    def correct(self, logits: torch.Tensor, tokens: torch.Tensor, matchers: Sequence[tuple[int, Matcher]]) -> None:
        """Masks after a greedy sampler, for CPU logits: row `i` of each `(i, matcher)` was sampled
        unmasked (`tokens[i]`) and gets the masked argmax. Where the matcher is `free`, a token it
        `takes` stays, else the first allowed of its highest logits (`_among_highest`); only the
        other rows have their masks filled (a row allowing nothing keeps its token). On the CPU the
        same cores fill the masks and run the forward: the dearest fill, in a long string, is the one
        most often spared."""
        start = time.perf_counter()
        sampled = tokens.tolist()
        refused = [(i, m) for i, m in matchers
                   if not (m.free and (m.takes(sampled[i]) or self._among_highest(logits, tokens, i, m)))]
        if refused:
            rows = [i for i, _ in refused]
            best = self._allowed_argmax(logits, rows, self.fill([m for _, m in refused]))
            at = torch.tensor(rows)
            tokens[at] = torch.where(best >= 0, best, tokens[at])
        self.mask_s += time.perf_counter() - start

    @staticmethod
    def _among_highest(logits: torch.Tensor, tokens: torch.Tensor, i: int, matcher: Matcher) -> bool:
        """Row `i`'s masked argmax found among its `CANDIDATES` highest logits without a mask
        (`tokens[i]` set; `matcher` is `free`): the first one its grammar allows, or the lowest id
        of those equal to it; False where none of them is allowed or equals may lie further."""
        top, ids = logits[i].topk(min(CANDIDATES, logits.shape[-1]))  # highest first
        top, ids = top.tolist(), ids.tolist()
        j = next((j for j, t in enumerate(ids) if matcher.takes(t)), None)
        if j is None or top[-1] == top[j]:
            return False
        tokens[i] = min(t for v, t in zip(top, ids) if v == top[j] and matcher.takes(t))
        return True

    def _allowed_argmax(self, logits: torch.Tensor, rows: list[int], host: torch.Tensor) -> torch.Tensor:
        """For each of `rows`, the first token of highest logit among those its bitmask row allows
        (-1: none). A row allowing tokens in at most `SPARSE_WORDS` mask words reads only their
        logits; a denser one is masked in place (`_addends`, as `apply`), then its argmax taken."""
        vocab, n = logits.shape[-1], len(rows)
        at = torch.tensor(rows)
        sparse = (host != 0).sum(-1) <= SPARSE_WORDS
        best = torch.full((n,), -1)
        if (dense := (~sparse).nonzero().flatten().tolist()):  # masked in place: nothing reads these logits again
            add = self._addends(host[dense], logits.dtype)
            for k, j in enumerate(dense):
                best[j] = logits[rows[j]].add_(add[k, :vocab]).argmax()
        row, word = (host * sparse.unsqueeze(-1)).nonzero(as_tuple=True)  # by row, then word: token order
        if not len(row):
            return best
        ids = word.unsqueeze(-1) * 32 + torch.arange(32)  # (P, 32)
        allowed = ((host[row, word].unsqueeze(-1) >> self._bits) & 1).bool() & (ids < vocab)
        values = logits[at[row].unsqueeze(-1), ids.clamp(max=vocab - 1)].float().masked_fill_(~allowed, float("-inf"))
        bit = values.argmax(-1)  # the first highest in its word
        top = values.gather(1, bit.unsqueeze(-1)).squeeze(-1)
        high = torch.full((n,), float("-inf")).scatter_reduce_(0, row, top, "amax")
        hits = (top == high[row]).nonzero().flatten()  # the words holding their row's highest, in order
        first = torch.full((n,), len(row)).scatter_reduce_(0, row[hits], hits, "amin")
        found = first < len(row)
        first = first.clamp(max=len(row) - 1)
        return torch.where(found, ids[first, bit[first]], best)

    def _addends(self, host: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The bitmask rows as values to add to CPU logits (0 allowed, -inf not), each byte looking
        its 8 values up in a table: faster than `masked_fill_` (4.6 vs 8 ms a step of 64 rows)."""
        if self._table is None or self._table.dtype != dtype:
            # byte k of a row, bit j: token 8 k + j (the int32 words are little-endian)
            bits = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1
            self._table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf"))
        if self._add is None or self._add.shape[0] < len(host) or self._add.dtype != dtype:
            self._add = torch.empty(len(host), host.shape[1] * 32, dtype=dtype)
        add = self._add[:len(host)]
        torch.index_select(self._table, 0, host.view(torch.uint8).flatten().long(), out=add.view(-1, 8))
        return add


def _bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """Host rows of 32 token ids per int32 (pinned where CUDA is, for the copy to the device)."""
    return torch.empty((rows, (vocab_size + 31) // 32), dtype=torch.int32, pin_memory=torch.cuda.is_available())
