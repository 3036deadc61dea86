"""Custom metrics exported by every deployment (shown by the Ray dashboard / Prometheus)."""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

from deployments.core.generation import Generation
from deployments.core.llm_inputs import PendingRequest
from deployments.core.llm_replica import ReplicaListener
from deployments.core.request_core import RequestListener
from encoder_service.pool import BatchRecord, Lookup, PoolListener
from llm_service.engine.llm_engine import EngineStats, LLMEngine, TokenEvent
from llm_service.model.experts import imbalance

_LATENCY_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]
_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
_RATIOS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]


class RouterMetrics(RequestListener):
    """The request core's reports as Ray metrics, plus this replica's failover counters."""

    def __init__(self):
        self.requests = Counter("mmserve_router_requests", "Chat requests by outcome", tag_keys=("outcome",))
        self.media_items = Counter("mmserve_router_media_items", "Media items dispatched to the encoder")
        self.prompt_tokens = Counter("mmserve_router_prompt_tokens", "Prompt tokens (media tokens included)")
        self.ttft_ms = Histogram("mmserve_router_ttft_ms", "Time to first token", boundaries=_LATENCY_MS)
        self.tpot_ms = Histogram("mmserve_router_tpot_ms", "Mean time per output token after the first", boundaries=_LATENCY_MS)
        self.resubmits = Counter("mmserve_router_llm_resubmits", "Requests resubmitted after an LLM replica was lost")
        self.reencoded_items = Counter("mmserve_router_reencoded_items", "Media items encoded again after their encoder replica was lost")
        self.resumed_tokens = Counter("mmserve_router_resumed_tokens", "Tokens already sent that failover continuations carried")
        self._failovers = dict.fromkeys(("resubmits", "resumed_streams", "resumed_tokens", "resumed_with_media",
                                         "reencoded_items"), 0)

    def on_outcome(self, outcome: str) -> None:
        self.requests.inc(tags={"outcome": outcome})

    def on_started(self, gen: Generation, ttft_ms: float, num_media: int) -> None:
        self.prompt_tokens.inc(len(gen.plan.token_ids))
        self.ttft_ms.observe(ttft_ms)
        if num_media:
            self.media_items.inc(num_media)

    def on_finished(self, gen: Generation) -> None:
        if (tpot := gen.time_per_output_token_ms) is not None:
            self.tpot_ms.observe(tpot)

    def on_resubmit(self, continuation: PendingRequest) -> None:
        self.resubmits.inc()
        self._failovers["resubmits"] += 1
        if sent := continuation.resumed_tokens:
            self.resumed_tokens.inc(sent)
            self._failovers["resumed_streams"] += 1
            self._failovers["resumed_tokens"] += sent
            self._failovers["resumed_with_media"] += bool(continuation.embeddings)

    def on_reencode(self, num_items: int) -> None:
        self.reencoded_items.inc(num_items)
        self._failovers["reencoded_items"] += num_items

    def failover_stats(self) -> dict:
        return dict(self._failovers)


class AffinityMetrics:
    def __init__(self):
        self.routed = Counter("mmserve_router_affinity_routed", "Encoder items and LLM requests routed, by outcome "
                              "(held: to a replica it was sent to before / owner / overflow; prefix_hit / no_prefix / overloaded)", tag_keys=("target", "outcome"))
        self.prefix_tokens = Histogram("mmserve_router_prefix_tokens", "Prompt tokens the chosen LLM replica likely "
                                       "holds cached (the router's record)", boundaries=_SIZES)


class EncoderMetrics:
    def __init__(self):
        self.items = Counter("mmserve_encoder_items", "Media items encoded", tag_keys=("kind",))
        self.tokens = Counter("mmserve_encoder_tokens", "Embedding tokens produced")
        self.failures = Counter("mmserve_encoder_failures", "Items that failed to decode or encode")
        self.encode_ms = Histogram("mmserve_encoder_encode_ms", "Preprocess + forward time per call", boundaries=_LATENCY_MS)
        self.in_flight = Gauge("mmserve_encoder_in_flight_items", "Items being preprocessed or encoded")
        self.queued_tokens = Gauge("mmserve_encoder_queued_tokens", "Output tokens of items admitted, not yet answered")
        self.batch_tokens = Histogram("mmserve_encoder_batch_tokens", "Cost (tokens/patches) per ViT forward", boundaries=_SIZES)
        self.batch_items = Histogram("mmserve_encoder_batch_items", "Items (pieces) per ViT forward", boundaries=_SIZES)
        self.batch_fill = Histogram("mmserve_encoder_batch_fill_ratio", "Batch cost / max_batch_tokens", boundaries=_RATIOS)
        self.batch_wait_ms = Histogram("mmserve_encoder_batch_wait_ms", "Oldest item's wait in the queue per batch", boundaries=_LATENCY_MS)
        self.forward_ms = Histogram("mmserve_encoder_forward_ms", "ViT forward time per batch", boundaries=_LATENCY_MS)
        self.cache_hits = Counter("mmserve_encoder_cache_hits", "Items answered from the embedding cache")
        self.cache_misses = Counter("mmserve_encoder_cache_misses", "Items not in the cache (nor in flight)")
        self.dedup_hits = Counter("mmserve_encoder_dedup_hits", "Items sharing an identical item's in-flight encode")
        self.cache_bytes = Gauge("mmserve_encoder_cache_bytes", "Bytes held by the embedding cache")


class PoolMetrics(PoolListener):
    """An `EncoderPool`'s reports as `EncoderMetrics` (the Encoder deployment's, or a colocated LLM's)."""

    def __init__(self, metrics: EncoderMetrics):
        self.metrics = metrics

    def on_lookup(self, outcome: Lookup) -> None:
        m = self.metrics
        {"hit": m.cache_hits, "miss": m.cache_misses, "dedup": m.dedup_hits}[outcome].inc()

    def on_batch(self, record: BatchRecord) -> None:
        m = self.metrics
        for histogram, value in ((m.batch_tokens, record.cost), (m.batch_items, record.items),
                                 (m.batch_fill, record.fill_ratio), (m.batch_wait_ms, record.wait_ms),
                                 (m.forward_ms, record.forward_ms)):
            histogram.observe(value)

    def on_queue(self, queued_tokens: int, queued_items: int, cache_bytes: int) -> None:
        self.metrics.queued_tokens.set(queued_tokens)
        self.metrics.in_flight.set(queued_items)
        self.metrics.cache_bytes.set(cache_bytes)


_EXPERT_TOKENS = [0.5, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096]


class LLMMetrics(ReplicaListener):
    """The replica core's reports as Ray metrics: per request, and the engine's gauges (queues, KV
    blocks, state snapshots, preemptions, tokens/s, grammar and MoE expert load) every interval."""

    def __init__(self):
        self.generated = Counter("mmserve_llm_generated_tokens", "Output tokens generated")
        self.embedding_wait_ms = Histogram(
            "mmserve_llm_embedding_wait_ms", "Wait for media embeddings after admission", boundaries=_LATENCY_MS
        )
        self.embedding_bytes = Counter("mmserve_llm_embedding_bytes", "Embedding bytes received (object store)")
        self.finished = Counter("mmserve_llm_finished", "Finished requests by reason", tag_keys=("reason",))
        self.waiting = Gauge("mmserve_llm_waiting_requests", "Requests waiting for KV blocks or budget")
        self.scheduled = Gauge("mmserve_llm_running_requests", "Requests in the running batch")
        self.kv_blocks_used = Gauge("mmserve_llm_kv_blocks_used", "KV cache blocks in use")
        self.kv_usage = Gauge("mmserve_llm_kv_usage_ratio", "Fraction of the KV block pool in use")
        self.preemptions = Counter("mmserve_llm_preemptions", "Requests preempted (KV recomputed later)")
        self.ttft_ms = Histogram("mmserve_llm_ttft_ms", "Admission to first token", boundaries=_LATENCY_MS)
        self.itl_ms = Histogram("mmserve_llm_inter_token_ms", "Time between output tokens", boundaries=_LATENCY_MS)
        self.tokens_per_s = Gauge("mmserve_llm_tokens_per_s", "Output tokens/s over the last interval")
        self.state_snapshots = Gauge("mmserve_llm_state_snapshots",
                                     "Linear-attention state snapshots held for prefix caching (hybrid models)")
        self.state_snapshot_bytes = Gauge("mmserve_llm_state_snapshot_bytes", "Bytes those state snapshots fill")
        self.grammar_requests = Counter("mmserve_llm_grammar_requests",
                                        "Requests with a response_format grammar, by whether it was cached",
                                        tag_keys=("cached",))
        self.grammar_compile_ms = Histogram("mmserve_llm_grammar_compile_ms", "Compile time of a response_format "
                                            "grammar", boundaries=_LATENCY_MS)
        self.grammar_mask_s = Counter("mmserve_llm_grammar_mask_seconds",
                                      "Engine-thread seconds spent filling and applying grammar token masks")
        self.moe_tokens_per_expert = Histogram(
            "mmserve_llm_moe_tokens_per_expert", "Tokens an expert received per forward, averaged over the MoE "
            "layers; one observation per expert per interval (MoE models)", boundaries=_EXPERT_TOKENS)
        self.moe_load_imbalance = Gauge("mmserve_llm_moe_load_imbalance", "Max over mean tokens per expert over the "
                                        "last interval, worst MoE layer (1 = even)")
        self._mask_s_exported = 0.0

    def on_embeddings(self, wait_ms: float, num_bytes: int) -> None:
        self.embedding_wait_ms.observe(wait_ms)
        self.embedding_bytes.inc(num_bytes)

    def on_grammar(self, cached: bool) -> None:
        self.grammar_requests.inc(tags={"cached": str(cached).lower()})

    def on_event(self, event: TokenEvent, first: bool, since_last_ms: float) -> None:
        if event.token_id is not None:
            (self.ttft_ms if first else self.itl_ms).observe(since_last_ms)
            self.generated.inc()
        if event.finish_reason:
            self.finished.inc(tags={"reason": event.finish_reason})

    def on_stats(self, engine: LLMEngine, stats: EngineStats, last: EngineStats, interval_s: float) -> None:
        self.scheduled.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_usage.set(stats.kv_blocks_used / max(stats.kv_blocks_total, 1))
        self.state_snapshots.set(stats.num_snapshots)
        self.state_snapshot_bytes.set(stats.snapshot_bytes)
        if stats.num_preemptions > last.num_preemptions:
            self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.tokens_per_s.set((stats.num_generated - last.num_generated) / interval_s)
        if (spent := engine.masks.mask_s - self._mask_s_exported) > 0:
            self.grammar_mask_s.inc(spent)
            self._mask_s_exported += spent
        while (compiler := engine.grammar_compiler) is not None and compiler.stats.compile_s:
            self.grammar_compile_ms.observe(compiler.stats.compile_s.pop(0) * 1000)
        if (load := engine.runner.expert_load.drain()) is not None:  # MoE models: tokens per expert per forward
            counts, forwards = load
            for tokens in (counts.double().mean(dim=0) / max(forwards, 1)).tolist():
                self.moe_tokens_per_expert.observe(tokens)
            self.moe_load_imbalance.set(imbalance(counts))
