"""Engine configuration: resolved once, never mutated. Each field with a description is a setting
of the app (`engine.<name>`, `mmserve.settings`); the others are set by the LLM replica or tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmserve.settings import check_fields, setting


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
    prompt block boundaries (`llm_service.hybrid.state_snapshots`): `state_snapshot_share` of the
    budget, or `num_state_snapshots` rows (with `num_kv_blocks`: one per block unless given).
    Where the others act: `cuda_graphs`, `max_graph_batch_size`: `llm_service.model.cuda_graphs`;
    `attention_backend`: `llm_service.model.attention` (checked when the model runner starts); `async_scheduling`:
    `llm_service.engine.llm_engine`; `split_kv_decode`: `mmserve.kernels.triton_attention.decode_splits`;
    `fused_ops`: `llm_service.model.fused_ops`; `grammar_*`: `llm_service.grammar`; `max_loras`:
    `llm_service.model.lora.LoraSet`; `tensor_parallel_size`: `llm_service.model.tensor_parallel` (the group is
    the caller's). `max_model_len` None is the checkpoint's (`mmserve.checkpoint.resolve_max_model_len`, resolved
    once on each node by `AppArgs.on_node`); the model runner refuses to start when the KV pool cannot hold one
    sequence that long, except with `num_kv_blocks` (tests' tiny pools, taken as given: a prompt over the pool is
    refused, a sequence that outgrows it alone ends with `length`).
    """

    block_size: int = setting(16, "tokens per KV block (a power of two)", ge=1)
    max_model_len: int | None = setting(
        None, "longest sequence served: prompt + max_tokens over it is refused (400); default: the checkpoint's "
        "max_position_embeddings, which it may not exceed. An LLM replica whose KV pool cannot hold one sequence "
        "this long refuses to start, naming the largest that fits", ge=1)
    max_num_seqs: int = setting(64, "sequences per engine step", ge=1)
    max_num_batched_tokens: int = setting(2048, "token budget per engine step", ge=1)
    enable_chunked_prefill: bool = setting(True, "prefill a long prompt over several steps (off: one over the "
                                           "budget runs alone in its step)")
    kv_cache_bytes: int | None = setting(None, ge=1)
    num_kv_blocks: int | None = setting(None, ge=1)
    num_state_slots: int | None = setting(None, ge=1)
    state_snapshot_share: float = setting(
        0.1, "hybrid linear-attention models: share of the KV memory budget for recurrent-state snapshots at "
        "prompt block boundaries (system prompt, images, prompt end), which prefix caching needs to resume them; "
        "0 turns their prefix caching off", ge=0, lt=0.5)
    num_state_snapshots: int | None = setting(None, ge=0)
    gpu_memory_utilization: float = setting(
        0.9, "of the LLM replica's share of its GPU (llm.num_gpus below 1, else the whole device): weights + KV "
        "pool; the rest of the share is headroom (activations, CUDA graphs)", gt=0, le=1)
    device_share: float = setting(1.0, gt=0, le=1)
    cuda_graphs: bool = setting(True, "CUDA: capture decode-only steps as graphs")
    max_graph_batch_size: int = 64
    max_logprobs: int = 20
    max_loras: int = setting(0, "LoRA adapters kept loaded per LLM replica (least recently used dropped); 0: as "
                             "many as lora_modules lists", ge=0)
    max_lora_rank: int = setting(16, "the largest LoRA rank (r) an adapter may have (the Triton path's slots "
                                 "hold this rank)", ge=1)
    enable_prefix_caching: bool = setting(True, "reuse K/V of identical prompt prefixes (images by content hash)")
    attention_backend: Literal["auto", "sdpa", "triton"] = setting(
        "auto", "auto: the Triton paged kernel on CUDA, SDPA on CPU (checked at replica start); triton runs on "
        "CPU only under TRITON_INTERPRET=1")
    async_scheduling: bool | None = setting(
        None, "overlap engine steps (the host prepares step N+1 while the device runs step N; stop ids and EOS "
        "apply a step late, the extra token is discarded; `response_format` masks are filled while the forward "
        "runs); default: on CUDA only (a CPU runs each op as it is launched)")
    split_kv_decode: bool = setting(True, "Triton backend: split a decode step's keys over more programs when its "
                                    "sequences x KV heads cannot fill the GPU (flash-decoding)")
    fused_ops: bool = setting(True, "CUDA, Triton backend: the decoder's RMSNorms and SiLU MLPs in fused kernels")
    tensor_parallel_size: int = setting(
        1, "ranks each LLM replica's decoder is split over (one process each, on one node: Serve reserves a "
        "placement group per replica, STRICT_PACK, one bundle per rank; with llm.num_gpus 1 one GPU per rank); "
        "every step is then an eager packed one (no decode graphs, no overlapped steps); above 1 refused with "
        "colocated, a fractional llm.num_gpus, or async_scheduling: true", ge=1)
    grammar_compile_timeout_s: float = setting(
        10.0, "response_format and forced tool calls: how long a request waits for its grammar to compile and "
        "for its n matchers (once per schema text, cached); past it the request is refused (400 / "
        "INVALID_ARGUMENT) and the compile runs on, cached when it ends. The Router compiles each request's "
        "grammar as the LLM replica does, within the same deadline, first", gt=0)
    grammar_threads: int | None = setting(
        None, "response_format and forced tool calls: threads filling a step's token masks (one row each at a "
        "time, beside the forward); default: the LLM replica's compute threads (llm.cpu_threads, else the node's "
        "cores shared among the replicas)", ge=1)

    def __post_init__(self):
        check_fields(self)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError(f"engine.tensor_parallel_size {self.tensor_parallel_size} with engine.async_scheduling: "
                             "true: a tensor-parallel step's inputs are sent to the other ranks before it runs, so "
                             "steps cannot overlap; leave async_scheduling unset (off with tensor parallelism)")
