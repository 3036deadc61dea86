"""Custom metrics exported by every deployment (shown by the Ray dashboard / Prometheus)."""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

_LATENCY_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]
_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
_RATIOS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]


class RouterMetrics:
    def __init__(self):
        self.requests = Counter("mmserve_router_requests", "Chat requests by outcome", tag_keys=("outcome",))
        self.media_items = Counter("mmserve_router_media_items", "Media items dispatched to the encoder")
        self.prompt_tokens = Counter("mmserve_router_prompt_tokens", "Prompt tokens (media tokens included)")
        self.ttft_ms = Histogram("mmserve_router_ttft_ms", "Time to first token", boundaries=_LATENCY_MS)
        self.tpot_ms = Histogram("mmserve_router_tpot_ms", "Mean time per output token after the first", boundaries=_LATENCY_MS)
        self.resubmits = Counter("mmserve_router_llm_resubmits", "Requests resubmitted after an LLM replica was lost")
        self.reencoded_items = Counter("mmserve_router_reencoded_items", "Media items encoded again after their encoder replica was lost")
        self.resumed_tokens = Counter("mmserve_router_resumed_tokens", "Tokens already sent that failover continuations carried")


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


class LLMMetrics:
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
