"""The app's pools as the capacity planner (`mmserve.capacity.simulate`) simulates them: a request's
progress, an LLM replica's continuous batching under a KV budget, and the Encoder deployment's
replicas with their calls."""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mmserve.capacity.caches import PrefixCache
from mmserve.capacity.events import BatchStation, OneAtATime, SharedCores, Simulator, serving
from mmserve.capacity.inputs import Profile
from mmserve.request.encode_calls import spread


@dataclass
class Request:
    """One simulated request: its shape, and how far it got (times in simulated seconds)."""

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
    `finished(request)` hears of each request done."""

    def __init__(self, sim: Simulator, profile: Profile, cores: SharedCores | OneAtATime | None = None,
                 encoder: BatchStation | None = None, prefix_cache: PrefixCache | None = None,
                 block_size: int = 16, finished: Callable[[Request], None] | None = None):
        self.sim, self.profile = sim, profile
        self._serve = serving(sim, cores)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
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
        room = math.inf if p.kv_tokens is None else p.kv_tokens - sum(r.kv for r in self.running)
        decoding = [r for r in self.running if r.prefilled == r.context]
        while len(decoding) > room:  # each decode takes one more token: preempt the youngest
            victim = self.running.pop()
            room += victim.kv
            if victim in decoding:
                decoding.remove(victim)
            self._release(victim)
            victim.preempt()
            self.waiting.appendleft(victim)
        room -= len(decoding)
        budget, chunks = p.max_batched_tokens, []
        for request in itertools.chain([r for r in self.running if r.prefilled < r.context], list(self.waiting)):
            if self.prefix_cache is not None and not (request.prefilled or request.held_blocks) \
                    and len(self.running) < p.max_num_seqs:
                self._reuse(request)
            chunk = min(budget, request.context - request.prefilled, room)
            if chunk <= 0:
                break
            if request in self.waiting:
                if len(self.running) >= p.max_num_seqs:
                    break
                self.waiting.remove(request)
                self.running.append(request)
            chunks.append((request, chunk))
            budget, room = budget - chunk, room - chunk
        if not decoding and not chunks:
            self.stepping = False
            return
        self.stepping = True
        seconds = p.step_s + p.prefill_token_s * (p.max_batched_tokens - budget) + p.decode_seq_s * len(decoding)
        self.busy_seconds += seconds
        self._serve(seconds, lambda: self._finish(decoding, chunks))

    def _finish(self, decoding: list[Request], chunks: list[tuple[Request, int]]) -> None:
        now = self.sim.now
        for request in decoding:
            request.decoded += 1
            request.kv += 1
        for request, chunk in chunks:
            request.prefilled += chunk
            request.kv += chunk
            if request.prefilled == request.context:  # the prefill samples a token: the first, or the next
                if self.prefix_cache is not None:
                    self.prefix_cache.register(request.block_hashes, request.held_blocks)
                    request.held_blocks = len(request.block_hashes)
                request.decoded += 1
                if request.first_token is None:
                    request.first_token = now
        for request in [r for r in self.running if r.decoded >= r.output_tokens]:
            request.finish = now
            self.running.remove(request)
            self._release(request)
            if self.finished is not None:
                self.finished(request)
        self._step()

    def _reuse(self, request: Request) -> None:
        """A prompt about to be admitted takes its cached prefix (the pool trimmed to make room first)."""
        cache = self.prefix_cache
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
        groups = spread(sizes)
        calls_left = [len(groups)]
        for group in groups:
            replica, items_left = self._pick(), [len(group)]
            self.calls[id(replica)] += 1

            def item_done(replica=replica, items_left=items_left) -> None:
                items_left[0] -= 1
                if not items_left[0]:
                    self.calls[id(replica)] -= 1
                    calls_left[0] -= 1
                    if not calls_left[0]:
                        done()

            for i in group:
                replica.submit(sizes[i], item_done)
