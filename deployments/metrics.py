"""Custom metrics exported by every deployment (shown by the Ray dashboard / Prometheus)."""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

_LATENCY_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]


class RouterMetrics:
    def __init__(self):
        self.requests = Counter("mmserve_router_requests", "Chat requests by outcome", tag_keys=("outcome",))
        self.media_items = Counter("mmserve_router_media_items", "Media items dispatched to the encoder")
        self.prompt_tokens = Counter("mmserve_router_prompt_tokens", "Prompt tokens (media tokens included)")
        self.ttft_ms = Histogram("mmserve_router_ttft_ms", "Time to first token", boundaries=_LATENCY_MS)
        self.tpot_ms = Histogram("mmserve_router_tpot_ms", "Mean time per output token", boundaries=_LATENCY_MS)


class EncoderMetrics:
    def __init__(self):
        self.items = Counter("mmserve_encoder_items", "Media items encoded", tag_keys=("kind",))
        self.tokens = Counter("mmserve_encoder_tokens", "Embedding tokens produced")
        self.failures = Counter("mmserve_encoder_failures", "Items that failed to decode or encode")
        self.encode_ms = Histogram("mmserve_encoder_encode_ms", "Preprocess + forward time per call", boundaries=_LATENCY_MS)
        self.in_flight = Gauge("mmserve_encoder_in_flight_items", "Items being preprocessed or encoded")


class LLMMetrics:
    def __init__(self):
        self.running = Gauge("mmserve_llm_requests", "Requests in the engine")
        self.generated = Counter("mmserve_llm_generated_tokens", "Output tokens generated")
        self.embedding_wait_ms = Histogram(
            "mmserve_llm_embedding_wait_ms", "Wait for media embeddings after admission", boundaries=_LATENCY_MS
        )
        self.embedding_bytes = Counter("mmserve_llm_embedding_bytes", "Embedding bytes received (object store)")
        self.finished = Counter("mmserve_llm_finished", "Finished requests by reason", tag_keys=("reason",))
