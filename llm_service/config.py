"""Engine configuration: resolved once, never mutated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How one LLM replica schedules, caches and runs.

    `kv_cache_bytes` sizes the paged KV pool; None means a default: on CUDA,
    `gpu_memory_utilization` of this replica's `device_share` of the device (the fraction of a GPU
    it was given: an encoder replica may own the rest) minus what it already holds (weights), and
    no more than the device has free (`llm_service.model.kv_cache.cuda_kv_budget`); on CPU 512 MiB.
    `num_kv_blocks` overrides both (tests use it for a tiny pool). Models with linear-attention
    layers also keep a recurrent state per running sequence, in state slots taken from the same
    budget (`max_num_seqs` of them, as long as they fill at most half of it, at least one);
    `num_state_slots` overrides that. With prefix caching, they also keep state snapshots at
    prompt block boundaries (`llm_service.hybrid.state_snapshots`): `state_snapshot_share` of the budget
    (0: prefix caching off for them), or `num_state_snapshots` rows (with `num_kv_blocks`: one
    per block unless given). `max_num_batched_tokens`
    is the per-step token budget; with `enable_chunked_prefill` a long prompt is prefilled
    over several steps, without it a prompt longer than the budget runs alone in its step.
    `cuda_graphs` captures decode-only steps (CUDA only) for batch sizes up to
    `max_graph_batch_size`. `enable_prefix_caching` reuses the K/V blocks of identical prompt
    prefixes (identical images included, by content hash) across requests. `attention_backend`:
    `auto` (Triton paged kernel on CUDA, SDPA on CPU), `sdpa` or `triton` (on CPU only under
    `TRITON_INTERPRET=1`); checked when the model runner starts, see `llm_service.model.attention`.
    `async_scheduling` overlaps steps (the host prepares step N+1 while the device runs step N,
    and reads the sampled ids a step late; see `llm_service.engine.llm_engine`); None: on for CUDA, where
    the device runs behind the host, off elsewhere (a CPU runs each op as it is launched).
    `split_kv_decode`: the Triton kernel splits a decode step's keys into slices when its
    sequences x KV heads are too few programs to fill the device (flash-decoding;
    `mmserve.kernels.triton_attention.decode_splits`). `fused_ops`: on CUDA with the Triton backend, the
    decoder's RMSNorms and SiLU MLPs run fused (`llm_service.model.fused_ops`).
    `max_model_len`: the longest sequence (prompt + generated tokens) served; None: the
    checkpoint's `max_position_embeddings`, which it may not exceed
    (`mmserve.checkpoint.resolve_max_model_len`, the router's value too). The model runner
    refuses to start when the KV pool cannot hold one sequence that long, except with
    `num_kv_blocks` (tests' tiny pools, taken as given: a prompt over the pool is refused, a
    sequence that outgrows it alone ends with `length`). `tensor_parallel_size`: the ranks the
    decoder is split over (`llm_service.model.tensor_parallel`; the group is the caller's, this says how
    many); above 1, every step is an eager packed one (no decode graphs, no overlapped steps).
    `grammar_compile_timeout_s`: how long a request waits for its `response_format` grammar to
    compile (`llm_service.grammar.GrammarCompiler`); past it the request is refused (the compile
    runs on and is cached when it ends).
    """

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    num_state_slots: int | None = None
    state_snapshot_share: float = 0.1
    num_state_snapshots: int | None = None
    gpu_memory_utilization: float = 0.9
    device_share: float = 1.0
    cuda_graphs: bool = True
    max_graph_batch_size: int = 64
    max_logprobs: int = 20
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    async_scheduling: bool | None = None
    split_kv_decode: bool = True
    fused_ops: bool = True
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    grammar_compile_timeout_s: float = 10.0

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if not 0 < self.gpu_memory_utilization <= 1 or not 0 < self.device_share <= 1:
            raise ValueError("gpu_memory_utilization and device_share must be in (0, 1]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be positive")
        if self.num_state_slots is not None and self.num_state_slots < 1:
            raise ValueError("num_state_slots must be positive")
        if not 0 <= self.state_snapshot_share < 0.5:
            raise ValueError(f"state_snapshot_share must be in [0, 0.5), got {self.state_snapshot_share}")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError("num_state_snapshots must not be negative")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError("async_scheduling needs tensor_parallel_size 1: a tensor-parallel step's inputs "
                             "are sent from the host before it runs")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be positive, got {self.grammar_compile_timeout_s}")
        if self.attention_backend not in ("auto", "sdpa", "triton"):
            raise ValueError(f"attention_backend must be auto, sdpa or triton, got {self.attention_backend!r}")
