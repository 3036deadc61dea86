"""The app's pools as the capacity planner (`mmserve.capacity.simulate`) simulates them: a request's
progress, an LLM replica's continuous batching under a KV budget, and the Encoder deployment's
replicas with their calls."""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

from mmserve.capacity.caches import PrefixCache
from mmserve.capacity.events import BatchStation, OneAtATime, SharedCores, Simulator, countdown, serving
from mmserve.capacity.inputs import Profile
from mmserve.request.encode_calls import spread


@dataclass(eq=False)
class Request:
    """One simulated request: its shape, and how far it got (times in simulated seconds). Requests
    compare by identity (the replicas' queues look them up)."""

    arrival: float
    image_sizes: tuple[int, ...]  # embedding tokens of each image
    prompt_tokens: int
    output_tokens: int
    first_token: float | None = None
    finish: float | None = None
    prefilled: int = 0  # tokens of `context` computed
    decoded: int = 0
    index: int = 0
    refused: bool = False
    context: int = 0  # tokens to prefill: the prompt, or after a preemption the prompt and its output so far
    kv: int = 0  # tokens it holds in its replica's KV cache
    preemptions: int = 0
    # with a prefix cache (the routing simulation): the prompt's block hashes, how many it holds
    block_hashes: tuple[int, ...] = ()
    held_blocks: int = 0
    cached_tokens: int = 0  # prompt tokens its replica's prefix cache served (the first admission)
    embedded: float | None = None  # when it reached its LLM replica (its images encoded and sent)
    # its LLM replica's bookkeeping: its place in `running`, and while it decodes, the replica's
    # step its `decoded` and `kv` were last brought up to (`LLMReplica._catch_up`)
    admission: int = 0
    decoding_since: int | None = None

    def __post_init__(self):
        self.context = self.prompt_tokens

    def preempt(self) -> None:
        self.context, self.prefilled, self.kv = self.prompt_tokens + self.decoded, 0, 0
        self.preemptions += 1


class LLMReplica:
    """Continuous batching: every step decodes each running sequence and prefills waiting prompts
    in order within the step's token budget and the KV cache's room. With a `prefix_cache`, a
    prompt admitted takes its cached prefix blocks (their prefill skipped; at least one token is
    computed), holds its whole prompt once prefilled, and frees it when done or preempted;
    `finished(request)` hears of each request done.

    A step costs the prompts it prefills and the sequences it ends, not every running one: a
    decoding sequence gains a token and a KV slot a step, so its counters are brought up to date
    only when read (`_catch_up`), `kv_held` sums them, and its last step is filed in `_ends` when
    its decoding starts."""

    def __init__(self, sim: Simulator, profile: Profile, cores: SharedCores | OneAtATime | None = None,
                 encoder: BatchStation | None = None, prefix_cache: PrefixCache | None = None,
                 block_size: int = 16, finished: Callable[[Request], None] | None = None):
        self.sim, self.profile = sim, profile
        self._serve = serving(sim, cores)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.prefilling: list[Request] = []  # the running ones short of their context, in admission order
        self.decoding = 0  # the running ones past it (each decodes a token a step)
        self.kv_held = 0  # KV tokens the running ones hold
        self.steps = 0  # steps done
        self._ends: dict[int, list[Request]] = {}  # step -> the decoding sequences it ends
        self._admissions = itertools.count()
        self.encoder = encoder  # colocated: the replica's own
        self.encoding = 0  # colocated: requests whose images it is encoding
        self.draining = False  # scaled down: finishes what it holds, takes nothing new
        self.stepping = False
        self.busy_seconds = 0.0
        self.prefix_cache, self.block_size, self.finished = prefix_cache, block_size, finished

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + len(self.running) + self.encoding

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        if not self.stepping:
            self._step()

    def _step(self) -> None:
        p = self.profile
        room = math.inf if p.kv_tokens is None else p.kv_tokens - self.kv_held
        while self.decoding > room:  # each decode takes one more token: preempt the youngest
            victim = self.running.pop()
            self._leave(victim)
            room += victim.kv
            self._release(victim)
            victim.preempt()
            self.waiting.appendleft(victim)
        room -= self.decoding
        budget, chunks = p.max_batched_tokens, []
        prefilling = list(self.prefilling)
        while len(chunks) < len(prefilling) or self.waiting:  # the running prompts, then the queue's head
            queued = len(chunks) >= len(prefilling)
            request = self.waiting[0] if queued else prefilling[len(chunks)]
            if self.prefix_cache is not None and not (request.prefilled or request.held_blocks) \
                    and len(self.running) < p.max_num_seqs:
                self._reuse(request)
            chunk = min(budget, request.context - request.prefilled, room)
            if chunk <= 0:
                break
            if queued:
                if len(self.running) >= p.max_num_seqs:
                    break
                self._admit(self.waiting.popleft())
            chunks.append((request, chunk))
            budget, room = budget - chunk, room - chunk
        if not self.decoding and not chunks:
            self.stepping = False
            return
        self.stepping = True
        seconds = p.step_s + p.prefill_token_s * (p.max_batched_tokens - budget) + p.decode_seq_s * self.decoding
        self.busy_seconds += seconds
        self._serve(seconds, lambda: self._finish(chunks))

    def _finish(self, chunks: list[tuple[Request, int]]) -> None:
        now = self.sim.now
        self.steps += 1
        self.kv_held += self.decoding  # each decoding sequence's new token
        ending = self._ends.pop(self.steps, [])
        for request, chunk in chunks:
            request.prefilled += chunk
            request.kv += chunk
            self.kv_held += chunk
            if request.prefilled == request.context:  # the prefill samples a token: the first, or the next
                if self.prefix_cache is not None:
                    self.prefix_cache.register(request.block_hashes, request.held_blocks)
                    request.held_blocks = len(request.block_hashes)
                request.decoded += 1
                if request.first_token is None:
                    request.first_token = now
                self.prefilling.remove(request)
                self.decoding += 1
                request.decoding_since = self.steps
                last = self.steps + max(request.output_tokens - request.decoded, 0)
                (ending if last == self.steps else self._ends.setdefault(last, [])).append(request)
        ending.sort(key=attrgetter("admission"))  # in running's order
        for request in ending:
            request.finish = now
            self.running.remove(request)
            self._leave(request)
            self._release(request)
            if self.finished is not None:
                self.finished(request)
        self._step()

    def _admit(self, request: Request) -> None:
        request.admission = next(self._admissions)
        self.running.append(request)
        self.prefilling.append(request)
        self.kv_held += request.kv

    def _leave(self, request: Request) -> None:
        """`request` (off `running`) gives back its KV tokens and its place among the decoding or prefilling."""
        self._catch_up(request)
        self.kv_held -= request.kv
        if request.decoding_since is None:
            self.prefilling.remove(request)
            return
        self.decoding -= 1
        request.decoding_since = None
        last = self._ends.get(self.steps + request.output_tokens - request.decoded)
        if last and request in last:  # preempted before its last step
            last.remove(request)

    def _catch_up(self, request: Request) -> None:
        """A decoding sequence's tokens and KV slots of the steps since it was last brought up to date."""
        if request.decoding_since is not None:
            steps, request.decoding_since = self.steps - request.decoding_since, self.steps
            request.decoded += steps
            request.kv += steps

    def _reuse(self, request: Request) -> None:
        """A prompt about to be admitted takes its cached prefix (the pool trimmed to make room first)."""
        cache = self.prefix_cache
        for r in self.running:
            self._catch_up(r)
        cache.trim(sum(-(-r.kv // self.block_size) for r in self.running))
        request.held_blocks = cache.acquire(request.block_hashes)
        reused = min(request.held_blocks * self.block_size, request.context - 1)
        request.prefilled = request.kv = reused
        if not request.preemptions:
            request.cached_tokens = reused

    def _release(self, request: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.release(request.block_hashes, request.held_blocks)
            request.held_blocks = 0


class EncoderPool:
    """The Encoder deployment: each replica batches its own queue of items by token budget. A
    request's items become calls by size (`spread`, the router's rule); each call goes to the
    replica with fewer calls in flight of two picked at random (Serve's power of two choices)."""

    def __init__(self, sim: Simulator, profile: Profile, replicas: int, cores: SharedCores | None,
                 rng: random.Random):
        self.sim, self.profile, self.cores, self.rng = sim, profile, cores, rng
        self.live: list[BatchStation] = []  # replicas taking calls
        self.every: list[BatchStation] = []  # and those scaled down, finishing their queues
        self.calls: dict[int, int] = {}  # replica (id) -> calls in flight
        for _ in range(replicas):
            self.add_server()

    def add_server(self) -> None:
        replica = BatchStation(self.sim, 1, self.profile.encode_seconds, max_cost=self.profile.max_batch_tokens,
                               cores=self.cores)
        self.live.append(replica)
        self.every.append(replica)
        self.calls[id(replica)] = 0

    def retire_server(self) -> None:
        """The replica with the least queued work takes no more calls (it finishes its queue)."""
        self.live.remove(min(self.live, key=lambda r: r.queued))

    @property
    def queued(self) -> float:
        return sum(r.queued for r in self.every)

    @property
    def busy_seconds(self) -> float:
        return sum(r.busy_seconds for r in self.every)

    def _pick(self) -> BatchStation:
        if len(self.live) == 1:
            return self.live[0]
        a, b = self.rng.sample(self.live, 2)
        return b if self.calls[id(b)] < self.calls[id(a)] else a

    def submit(self, sizes: tuple[int, ...], done: Callable[[], None]) -> None:
        """Encode items of these token counts; `done()` once every call is back."""
        groups = _calls(sizes)
        call_done = countdown(len(groups), done)
        for group in groups:
            replica = self._pick()
            self.calls[id(replica)] += 1
            item_done = countdown(len(group), functools.partial(self._call_back, replica, call_done))
            for i in group:
                replica.submit(sizes[i], item_done)

    def _call_back(self, replica: BatchStation, call_done: Callable[[], None]) -> None:
        self.calls[id(replica)] -= 1
        call_done()


@functools.lru_cache(maxsize=4096)
def _calls(sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """`spread`, once per request shape (a workload has few; a simulated run asks for each thousands of times)."""
    return tuple(map(tuple, spread(sizes)))
