"""Routing at cluster scale (`mmserve plan --routing-scale`): the whole cluster as one routing domain,
its encoder replicas' embedding caches and its LLM replicas' prefix caches (`mmserve.capacity.caches`)
fed by content with popularity (`Workload.image_pool` and the rest), routed by Serve's default
(`power_of_two`) or by affinity (`AffinityChooser` itself, the app's rules). One router sees every
request (the best case for affinity); the LLM request is routed at dispatch, as the app does, and
prefills once every embedding has crossed the transport. Warm-up, the "keeps up" test and the run
lengths: docs/capacity.md#routing-at-cluster-scale---routing-scale."""

from __future__ import annotations

import bisect
import functools
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from cachetools import LRUCache

from mmserve.capacity.caches import ENCODER_CACHE_BYTES, EmbeddingLRU, PrefixCache
from mmserve.capacity.events import BatchStation, Simulator, countdown
from mmserve.capacity.goodput import GROWTH, WINDOW_LATENCIES, meets, stability
from mmserve.capacity.inputs import SLO, Profile, Workload
from mmserve.capacity.replicas import LLMReplica, Request
from mmserve.capacity.simulate import percentile
from mmserve.request.encode_calls import affinity_spread, spread
from mmserve.inputs.media import PlaceholderRange
from mmserve.routing.affinity import AffinityChooser, power_of_two, prefix_hashes

POLICIES = ("default", "affinity")
MAX_REQUESTS_PER_GPU = 480  # a run too short to judge is extended up to this (`cluster_goodput`)
# the app's defaults: `routing.epsilon`, `routing.prefix_epsilon` (deployments/config.py RoutingArgs), the
# engine's block size (llm_service/config.py EngineConfig), the dispatcher's record of items sent
ENCODER_EPSILON, PREFIX_EPSILON, BLOCK_SIZE, SENT_ITEMS = 0.25, 0.1, 16, 1 << 16
ENCODER_SHARE = 0.25  # of a cluster's GPUs, encoder replicas (1 + 3 at 4 GPUs: `mmserve plan`'s pick)
IMAGE_TOKEN = 0  # the placeholder id (media keys tell images apart in the prefix hashes)


@dataclass(frozen=True)
class Content:
    """One request's content: its images ((key, embedding tokens)), lengths and prompt block hashes."""

    images: tuple[tuple[str, int], ...]
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]


def contents(workload: Workload, n: int, seed: int = 0, block_size: int = BLOCK_SIZE) -> list[Content]:
    """`n` requests of the workload's content: a new conversation ([a shared system prompt] images
    text) or, `multi_turn_share` of the time, the next turn of an earlier request drawn at random
    (its prompt and answer, new text; its images sent again). Images are drawn by Zipf popularity
    from `image_pool` (0: each image new)."""
    rng, fresh = random.Random(seed), itertools.count(1 << 20)  # unique token ids for text and answers
    pool = workload.image_pool
    cum = list(itertools.accumulate(k ** -workload.zipf_exponent for k in range(1, pool + 1)))
    pool_sizes = [workload.image_sizes(1, rng)[0] for _ in range(pool)]
    history: list[tuple[list, list, list, tuple]] = []  # (segments, ranges, keys, images) per request
    out = []

    def unique(length: int) -> range:
        start = next(fresh)
        for _ in range(length - 1):
            next(fresh)
        return range(start, start + length)

    for _ in range(n):
        text, answer = workload.length(workload.text_tokens, rng), workload.length(workload.output_tokens, rng)
        if history and rng.random() < workload.multi_turn_share:
            segments, ranges, keys, images = rng.choice(history)
            segments, ranges, keys = [*segments, unique(text)], list(ranges), list(keys)
        else:
            segments, ranges, keys, images = [], [], [], []
            if workload.system_prompts and rng.random() < workload.system_prompt_share:
                prompt = rng.randrange(workload.system_prompts)
                segments.append(range(-(prompt + 1) * 100_000, -(prompt + 1) * 100_000 + workload.system_prompt_tokens))
            offset = sum(len(s) for s in segments)
            for _ in range(rng.randint(*workload.images)):
                if pool:
                    k = bisect.bisect(cum, rng.random() * cum[-1])
                    key, tokens = f"img-{k}", pool_sizes[k]
                else:
                    key, tokens = f"new-{next(fresh)}", workload.image_sizes(1, rng)[0]
                ranges.append(PlaceholderRange(offset, tokens))
                keys.append(key)
                images.append((key, tokens))
                segments.append((IMAGE_TOKEN,) * tokens)
                offset += tokens
            segments.append(unique(text))
            images = tuple(images)
        token_ids = [t for s in segments for t in s]
        out.append(Content(images, len(token_ids), answer, prefix_hashes(token_ids, ranges, keys, block_size)))
        history.append(([*segments, unique(answer)], ranges, keys, images))
    return out


class EncoderReplica:
    """One encoder replica: a token-budget batching queue and its embedding cache; an item it is
    encoding already waits for that encode (the pool's in-flight dedupe)."""

    def __init__(self, sim: Simulator, profile: Profile, cache_bytes: int):
        self.station = BatchStation(sim, 1, profile.encode_seconds, max_cost=profile.max_batch_tokens)
        self.cache = EmbeddingLRU(cache_bytes)
        self.bytes_per_token = max(1, profile.embedding_token_bytes)
        self._encoding: dict[str, list[Callable[[], None]]] = {}

    def encode(self, key: str, tokens: int, done: Callable[[], None]) -> bool:
        """`done()` once `key`'s embedding is ready; whether it had to be encoded."""
        if self.cache.get(key):
            done()
            return False
        if key in self._encoding:
            self._encoding[key].append(done)
            return False
        self._encoding[key] = [done]
        self.station.submit(tokens, lambda: self._finish(key, tokens))
        return True

    def _finish(self, key: str, tokens: int) -> None:
        self.cache.put(key, tokens * self.bytes_per_token)
        for done in self._encoding.pop(key):
            done()


@dataclass(frozen=True)
class ClusterResult:
    policy: str
    num_encoders: int
    num_llms: int
    rate: float
    offered: float  # arrivals a second over the measured window (its first to its last arrival)
    throughput: float  # completions a second over the same window (any request's)
    backlog_growth: float  # the backlog's slope after the fill, a share of the rate a second (`stability`)
    latency_s: float  # median time in system of the measured requests
    judged: bool  # the run was long enough to tell a filling queue from a growing one
    requests: int  # arrivals simulated (warm-up included)
    ttft_p99_s: float
    tpot_p99_s: float
    encoder_hit_ratio: float  # items needing no encode (a cache hit or an encode in flight), of items sent
    prefix_hit_ratio: float  # prompt tokens the LLM replicas' prefix caches served, of all prompt tokens


def split(gpus: int, encoder_share: float = ENCODER_SHARE) -> tuple[int, int]:
    encoders = max(1, round(gpus * encoder_share))
    return encoders, gpus - encoders


def simulate_cluster(profile: Profile, shapes: Sequence[Content], num_encoders: int, num_llms: int, policy: str,
                     rate: float, seed: int = 0, burstiness: float = 1.0, warmup: float = 0.5,
                     transport: str = "object_store", cache_bytes: int = ENCODER_CACHE_BYTES,
                     arrivals: Sequence[float] | None = None, trace: dict | None = None) -> ClusterResult:
    """One run of `shapes` arriving at `rate`, routed by `policy` ("default" or "affinity").
    `arrivals`: the shapes' arrival times instead (a real run replayed: `routing_fit`); `trace`: a
    dict given here gets "requests" (every `Request`) and "misses" (items encoded per request)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, not {policy!r}")
    rng, sim = random.Random(seed), Simulator()
    encoder_ids, llm_ids = [f"e{i}" for i in range(num_encoders)], [f"l{i}" for i in range(num_llms)]
    encoders = {e: EncoderReplica(sim, profile, cache_bytes) for e in encoder_ids}
    kv_blocks = profile.kv_tokens // BLOCK_SIZE if profile.kv_tokens is not None else 1 << 40
    calls, requests = Counter(), Counter()  # in flight per replica (Serve's default policy's load)
    encoder_rules = AffinityChooser(ENCODER_EPSILON, BLOCK_SIZE, rng)
    llm_rules = AffinityChooser(PREFIX_EPSILON, BLOCK_SIZE, rng)
    sent: LRUCache[str, None] = LRUCache(maxsize=SENT_ITEMS)
    where: dict[int, tuple[str, int]] = {}  # request -> (LLM replica, its routed cost)
    first = math.floor(len(shapes) * warmup)
    items, misses, per_request = [0], [0], Counter()

    def released(rules: AffinityChooser, in_flight: Counter, replica: str, cost: int) -> None:
        if policy == "affinity":
            rules.completed(replica, cost)
        else:
            in_flight[replica] -= 1

    def finished(request: Request) -> None:
        released(llm_rules, requests, *where.pop(request.index))

    llms = {i: LLMReplica(sim, profile, prefix_cache=PrefixCache(kv_blocks), block_size=BLOCK_SIZE, finished=finished)
            for i in llm_ids}

    def dispatch(request: Request, shape: Content) -> None:
        measured = request.index >= first
        if policy == "affinity":
            llm, _, _ = llm_rules.choose_llm(shape.block_hashes, shape.prompt_tokens, shape.output_tokens, llm_ids)
            where[request.index] = llm, llm_rules.llm_routed(shape.block_hashes, shape.prompt_tokens,
                                                             shape.output_tokens, llm)
            seen = [key in sent for key, _ in shape.images]
            for key, _ in shape.images:
                sent[key] = None
            groups = affinity_spread([t for _, t in shape.images], seen)
        else:
            llm = power_of_two(llm_ids, requests, rng)
            requests[llm] += 1
            where[request.index] = llm, 0
            groups = spread([t for _, t in shape.images])
        def to_llm() -> None:
            request.embedded = sim.now
            llms[llm].add(request)

        if not groups:
            to_llm()
            return
        tokens = sum(t for _, t in shape.images)
        all_back = countdown(len(groups), lambda: sim.after(profile.transfer_seconds(tokens, transport), to_llm))

        def call_done(encoder: str, cost: int) -> None:
            released(encoder_rules, calls, encoder, cost)
            all_back()

        for group in groups:
            call = [shape.images[i] for i in group]
            if policy == "affinity":
                encoder, _ = encoder_rules.choose_encoder(call, encoder_ids)
                cost = encoder_rules.encoder_routed(call, encoder)
            else:
                encoder, cost = power_of_two(encoder_ids, calls, rng), 0
                calls[encoder] += 1
            item_done = countdown(len(call), functools.partial(call_done, encoder, cost))
            for key, size in call:
                encoded = encoders[encoder].encode(key, size, item_done)
                if measured:
                    items[0] += 1
                    misses[0] += encoded
                per_request[request.index] += encoded

    t, all_requests = 0.0, []
    for index, shape in enumerate(shapes):
        t = arrivals[index] if arrivals is not None else t + rng.gammavariate(burstiness, 1 / (rate * burstiness))
        request = Request(t, tuple(s for _, s in shape.images), shape.prompt_tokens, shape.output_tokens, index=index,
                          block_hashes=shape.block_hashes)
        all_requests.append(request)
        sim.at(t, lambda request=request, shape=shape: sim.after(profile.router_s, lambda: dispatch(request, shape)))
    sim.run()
    if trace is not None:
        trace.update(requests=all_requests, misses=per_request)

    measured = all_requests[first:]
    ttft = [r.first_token - r.arrival for r in measured]
    tpot = [(r.finish - r.first_token) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0 for r in measured]
    start, end = measured[0].arrival, measured[-1].arrival
    done = sum(1 for r in all_requests if start <= r.finish <= end)
    window = max(end - start, 1e-12)
    stable = stability([r.arrival for r in all_requests], [r.finish for r in all_requests], start)
    return ClusterResult(policy, num_encoders, num_llms, rate, (len(measured) - 1) / window, done / window,
                         stable.growth, stable.latency_s, stable.judged, len(shapes),
                         percentile(ttft, 99), percentile(tpot, 99), 1 - misses[0] / items[0] if items[0] else 0.0,
                         sum(r.cached_tokens for r in measured) / sum(r.prompt_tokens for r in measured))


_contents = functools.lru_cache(maxsize=4)(contents)  # the first n of a longer run's content are these


def cluster_goodput(profile: Profile, shapes: Sequence[Content], slo: SLO, gpus: int, policy: str,
                    workload: Workload, seed: int = 0, iterations: int = 6,
                    encoder_share: float = ENCODER_SHARE,
                    max_requests: int | None = None) -> tuple[float, ClusterResult | None]:
    """The highest rate (requests/s) at which p99 TTFT and TPOT stay within `slo` and the cluster
    keeps up (`stability`), by bisection; with the run at that rate. A run too short to judge is
    run again with twice the arrivals, up to `max_requests` (default: MAX_REQUESTS_PER_GPU x gpus)."""
    encoders, llms = split(gpus, encoder_share)
    cap = max(len(shapes), MAX_REQUESTS_PER_GPU * gpus if max_requests is None else max_requests)

    def run(rate: float) -> ClusterResult:
        n, run_shapes = len(shapes), shapes
        while True:
            result = simulate_cluster(profile, run_shapes, encoders, llms, policy, rate, seed, workload.burstiness)
            if result.judged or n >= cap:
                return result
            # the span the window needs (half the arrivals warm the caches), with a margin
            needed = math.ceil(1.2 * 2 * WINDOW_LATENCIES * result.latency_s * rate)
            while n < min(needed, cap):
                n *= 2
            n = min(n, cap)
            run_shapes = _contents(workload, n, seed)

    def ok(result: ClusterResult) -> bool:
        return meets(result, slo) and result.backlog_growth < GROWTH

    low, high, best = 0.0, 4.0 * gpus, None
    while ok(result := run(high)):
        low, high, best = high, high * 2, result
    for _ in range(iterations):
        mid = (low + high) / 2
        if ok(result := run(mid)):
            low, best = mid, result
        else:
            high = mid
    return low, best


TYPICAL = dict(images=(1, 4), image_tokens=400, text_tokens=64, output_tokens=128, image_pool=10_000,
               zipf_exponent=1.0, system_prompts=20, system_prompt_share=0.3, multi_turn_share=0.2)


def typical_workload(**changes) -> Workload:
    """The issue's typical workload: Zipf 1.0 over 10,000 images of 640^2 (400 tokens), 1-4 a
    request, 30% of requests opening with one of 20 system prompts (512 tokens), 20% a next turn."""
    return replace(Workload(rate=1.0, **TYPICAL), **changes)


@dataclass(frozen=True)
class ScaleRow:
    workload: str
    gpus: int
    default: ClusterResult | None  # the run at each policy's goodput (None: no rate met the SLOs)
    affinity: ClusterResult | None
    default_goodput: float
    affinity_goodput: float

    @property
    def ratio(self) -> float:
        return self.affinity_goodput / self.default_goodput if self.default_goodput else math.inf

    def policies(self) -> tuple[tuple[str, ClusterResult | None, float], ...]:
        """(policy, the run at its goodput, goodput) for each policy."""
        return ("default", self.default, self.default_goodput), ("affinity", self.affinity, self.affinity_goodput)


def routing_scale(profile: Profile, workloads: dict[str, Workload], sizes: Sequence[int], slo: SLO,
                  requests_per_gpu: int = 60, seed: int = 0, iterations: int = 6,
                  progress: Callable[[ScaleRow], None] | None = None,
                  max_requests_per_gpu: int | None = None) -> list[ScaleRow]:
    """Each workload at each cluster size under both policies: goodput, and the run at it (runs
    of at least `requests_per_gpu` arrivals per GPU, at most `max_requests_per_gpu`)."""
    rows = []
    for name, workload in workloads.items():
        for gpus in sizes:
            shapes = contents(workload, gpus * requests_per_gpu, seed)
            cap = gpus * (max_requests_per_gpu or MAX_REQUESTS_PER_GPU)
            (dg, dr), (ag, ar) = (cluster_goodput(profile, shapes, slo, gpus, policy, workload, seed, iterations,
                                                  max_requests=cap) for policy in POLICIES)
            rows.append(ScaleRow(name, gpus, dr, ar, dg, ag))
            if progress:
                progress(rows[-1])
    return rows
