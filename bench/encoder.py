"""Encoder batching benchmark: one item per forward vs `@serve.batch` by count vs the token-budget pool.

    python bench/encoder.py                 # CPU, tiny Qwen2-VL, a few minutes
    python bench/encoder.py --device cuda   # full-size Qwen2-VL-7B vision tower alone (random weights)
    python bench/encoder.py --vit-attention loop   # transformers' per-segment loop (before packing)

All variants run in this process on the same encoder and the same burst of concurrent requests
(one image each, sizes 224^2..1024^2 scaled to the model), with the same preprocessing workers;
only the batching differs. The workers only decode: the processor runs with the forward, on the
device, so "forwards alone" includes it. `queued_bytes_per_1024_image` is what the pool's queue
(and its `max_queued_bytes` cap) holds for one 1024x1024 image. On CUDA each MFU is printed
beside its ceiling: the forward if its matmuls ran at the rate measured for the tower's GEMM
shapes and its attention at the rate measured for the attention it calls, and nothing else took
time (`ceiling`), with the forward's fraction of it. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

from encoder_service.batching import BatchConfig
from encoder_service.pool import EncoderPool, PoolConfig
from mmserve.loadgen.dataset import image_bytes
from mmserve.inputs.media import EncodeItem, MediaItem, MediaKind

REAL_SIDES = (224, 448, 672, 896, 1024)


def workload(n: int, scale: float, seed: int = 0) -> list[MediaItem]:
    rng = random.Random(seed)
    items = []
    for k in range(n):
        side = rng.choice(REAL_SIDES)
        aspect = rng.choice((1.0, 0.75, 4 / 3))
        h, w = max(28, int(side * scale * aspect ** 0.5)), max(28, int(side * scale / aspect ** 0.5))
        items.append(MediaItem(MediaKind.IMAGE, (image_bytes(h, w, seed * 100_000 + k),)))
    return items


def tiny_checkpoint(scale: float) -> str:
    """The embedded tiny Qwen2-VL, its processor allowed up to 1024^2 * scale^2 pixels."""
    from mmserve.tiny import ensure_tiny_model

    src = Path(ensure_tiny_model())
    dst = Path(tempfile.mkdtemp(prefix="mmserve-bench-")) / "tiny_qwen2_vl"
    shutil.copytree(src, dst)
    cfg_path = dst / "processor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["image_processor"]["size"]["longest_edge"] = int((1024 * scale) ** 2 * 1.1)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return str(dst)


async def burst(encode, items: list[MediaItem]) -> float:
    start = time.perf_counter()
    await asyncio.gather(*[encode([item]) for item in items])
    return time.perf_counter() - start


async def run_pool(encoder, items, batch: BatchConfig, workers: int, cache_bytes: int = 0, repeat: int = 1,
                   queued_bytes: int = 1 << 30):
    pool = EncoderPool(encoder, PoolConfig(batch, preprocess_workers=workers, cache_bytes=cache_bytes,
                                           max_queued_bytes=queued_bytes))
    try:
        await burst(pool.encode, items[:4])  # warm-up (threads, allocator)
        seconds = [await burst(pool.encode, items) for _ in range(repeat)]
        return seconds[-1], pool.stats()
    finally:
        await pool.close()


async def run_serve_batch(encoder, items, max_batch_size: int, wait_s: float, workers: int):
    """Ray Serve's own `@serve.batch` (by count): preprocess the batch on the workers, one forward."""
    from ray import serve
    from ray.serve import batching

    # Outside a replica only this warning's lookup of the replica's config fails; skip it.
    batching._BatchQueue._warn_if_max_batch_size_exceeds_max_ongoing_requests = lambda self: None
    preprocess = ThreadPoolExecutor(workers)
    device = ThreadPoolExecutor(1)

    class CountBatcher:
        @serve.batch(max_batch_size=max_batch_size, batch_wait_timeout_s=wait_s)
        async def encode(self, batch: list[list[EncodeItem]]) -> list[list[tuple[torch.Tensor, ...]]]:
            loop = asyncio.get_running_loop()
            flat = [item for req in batch for item in req]
            prepared = await asyncio.gather(*[loop.run_in_executor(preprocess, encoder.preprocess, i) for i in flat])
            return [[o] for o in await loop.run_in_executor(device, encoder.forward, prepared)]

    batcher = CountBatcher()
    await burst(batcher.encode, items[:4])
    try:
        return await burst(batcher.encode, items)
    finally:
        preprocess.shutdown()
        device.shutdown()


def forward_seconds(encoder, items, max_tokens: int, repeat: int = 3) -> float:
    """Device time alone: the items prepared once, forwarded in token-budget batches (best of
    `repeat`) on one worker thread, as the pool's device thread runs them (on a busy CPU the main
    thread's forwards were up to 10x slower and as noisy)."""
    prepared = [encoder.preprocess(i) for i in items]
    batches, tokens = [[]], 0
    for p in prepared:
        if batches[-1] and tokens + p.num_tokens > max_tokens:
            batches.append([])
            tokens = 0
        batches[-1].append(p)
        tokens += p.num_tokens
    def run() -> float:
        start = time.perf_counter()
        for batch in batches:
            encoder.forward(batch)
        return time.perf_counter() - start

    with ThreadPoolExecutor(1) as device:
        return min(device.submit(run).result() for _ in range(repeat))


def queued_bytes_per_1024_image(encoder) -> int:
    """Bytes the pool queues for one 1024x1024 image (`PreparedItem.num_bytes`)."""
    return encoder.preprocess(encoder.plan(MediaItem(MediaKind.IMAGE, (image_bytes(1024, 1024, 1),)))).num_bytes


def cpu_table(args) -> dict:
    from encoder_service import VisionEncoder

    model = args.model or tiny_checkpoint(args.scale)
    encoder = VisionEncoder(model, dtype=args.dtype, device="cpu")
    if args.vit_attention == "loop":
        encoder.tower.config._attn_implementation = "sdpa"  # one SDPA call per segment per layer
    items = [encoder.plan(item) for item in workload(args.items, args.scale)]  # what routers send
    tokens = sum(item.cost for item in items)
    budget = BatchConfig(max_batch_tokens=args.max_batch_tokens, max_batch_items=256, batch_wait_ms=args.wait_ms)
    single = BatchConfig(max_batch_tokens=args.max_batch_tokens, max_batch_items=1, batch_wait_ms=0)
    w = args.workers
    t_single, _ = asyncio.run(run_pool(encoder, items, single, w))
    t_count = asyncio.run(run_serve_batch(encoder, items, args.count_batch, args.wait_ms / 1000, w))
    t_budget, stats = asyncio.run(run_pool(encoder, items, budget, w))
    t_hit, hit_stats = asyncio.run(run_pool(encoder, items, budget, w, cache_bytes=1 << 30, repeat=2))
    assert hit_stats.cache_hits >= len(items)
    t_forward = forward_seconds(encoder, items, args.max_batch_tokens)
    rows = [
        ("(a) one item per forward", t_single),
        (f"(b) @serve.batch, {args.count_batch} per batch", t_count),
        (f"(c) token budget {args.max_batch_tokens}", t_budget),
        ("cache hits (c, warm)", t_hit),
        ("(c) forwards alone (prepared once)", t_forward),
    ]
    print(f"\n{len(items)} concurrent requests, 1 image each, {tokens} tokens; model {Path(model).name}, "
          f"{args.dtype}, CPU, {w} preprocess workers, ViT attention {args.vit_attention}; "
          f"budget batches: {stats.forwards} forwards")
    print(f"{'variant':38s} {'items/s':>9s} {'tokens/s':>10s} {'vs (a)':>7s}")
    for name, secs in rows:
        print(f"{name:38s} {len(items) / secs:9.1f} {tokens / secs:10.0f} {t_single / secs:6.2f}x")
    queued = queued_bytes_per_1024_image(encoder)
    print(f"{'queued bytes per 1024^2 image':38s} {queued:9d}")
    return {
        "queued_bytes_per_1024_image": queued,
        "items": len(items), "tokens": tokens, "vit_attention": args.vit_attention,
        "single_items_per_s": len(items) / t_single,
        "count_batch_items_per_s": len(items) / t_count,
        "token_budget_items_per_s": len(items) / t_budget,
        "token_budget_tokens_per_s": tokens / t_budget,
        "token_budget_vs_single": t_single / t_budget,
        "token_budget_vs_count": t_count / t_budget,
        "cache_hit_items_per_s": len(items) / t_hit,
        "token_budget_forward_items_per_s": len(items) / t_forward,
    }


class FullSizeTower:
    """Full-size Qwen2-VL vision tower with random weights on CUDA, shaped like `VisionEncoder`."""

    def __init__(self, dtype: torch.dtype, vit_attention: str):
        from transformers import Qwen2VLImageProcessor
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

        from encoder_service.cache import EncoderIdentity
        from encoder_service.families.qwen2_vl import QwenVLEncoderFace
        from mmserve.families.qwen2_vl import VisionPreprocessConfig

        self.config = Qwen2VLVisionConfig(hidden_size=3584)  # Qwen2-VL-7B's vision tower
        self.config._attn_implementation = "sdpa"
        self.tower = Qwen2VisionTransformerPretrainedModel._from_config(self.config, dtype=dtype).cuda().eval()
        if vit_attention == "packed":
            from encoder_service.vit_attention import use_packed_attention

            use_packed_attention(self.tower)
        max_pixels = 1024 * 1024 * 2
        self.identity = EncoderIdentity("qwen2-vl-random", "random", "default", str(dtype))
        # the real face (decode in preprocess; processor, forward and split on the device), without a
        # checkpoint directory for its processors
        self._face = QwenVLEncoderFace.__new__(QwenVLEncoderFace)
        self._face.dtype, self._face.merge = dtype, self.config.spatial_merge_size
        self._face.image_processor = Qwen2VLImageProcessor(max_pixels=max_pixels)
        self._face.sizes = VisionPreprocessConfig(max_pixels=max_pixels)
        self._face.config, self._face.graphs = SimpleNamespace(model_type="qwen2_vl"), None
        self.split = self._face.split

    def plan(self, item: MediaItem) -> EncodeItem:
        return EncodeItem(item, None, self.preprocess(EncodeItem(item, None, 0)).num_tokens)

    def preprocess(self, item: EncodeItem):
        return self._face.preprocess(item.item, item.layout)

    @torch.inference_mode()
    def forward(self, prepared):
        return [tuple(p.to("cpu") for p in parts) for parts in self._face.forward(self.tower, prepared)]


def flops_by_kind(config, grid: tuple[int, int, int]) -> tuple[float, float]:
    """(matmul, attention) FLOPs of one item's forward through a Qwen2-VL vision tower: 24 d^2 per patch
    per block (qkv, proj, 4x MLP) + the merger, and 4 n d per patch of attention."""
    c = config
    patches = grid[0] * grid[1] * grid[2]
    seq = grid[1] * grid[2]
    merged = patches // 4
    merger = 2 * merged * (4 * c.embed_dim) * (4 * c.embed_dim) + 2 * merged * 4 * c.embed_dim * c.hidden_size
    return c.depth * 24 * c.embed_dim ** 2 * patches + merger, c.depth * 4 * patches * seq * c.embed_dim


def ceiling(config, grid: tuple[int, int, int], items: int, dtype: torch.dtype,
            device: torch.device) -> tuple[float, float, float]:
    """What the measured parts allow: (images/s, matmul TFLOP/s, attention TFLOP/s). The rates are
    measured here, for the forward of `items` such images at once: the tower's four GEMM shapes,
    and the attention function the tower calls over `items` segments. The ceiling is that forward
    if its matmuls and attention ran at those rates and nothing else (norms, rotary, the merger's
    elementwise work, launches) took any time."""
    from encoder_service.vit_attention import packed_attention

    c, seq = config, grid[1] * grid[2]
    patches, d, heads = items * grid[0] * seq, c.embed_dim, c.num_heads
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    x, wide = rand(patches, d), rand(patches, 4 * d)
    weights = [(x, rand(3 * d, d)), (x, rand(d, d)), (x, rand(4 * d, d)), (wide, rand(d, 4 * d))]
    matmul_s = device_seconds(lambda: [torch.nn.functional.linear(a, w) for a, w in weights], device)
    matmul_rate = 24 * patches * d * d / matmul_s
    q, k, v = (rand(1, heads, patches, d // heads) for _ in range(3))
    cu = torch.arange(0, patches + 1, seq, dtype=torch.int32, device=device)
    attention_s = device_seconds(lambda: packed_attention(None, q, k, v, cu_seq_lens_q=cu, max_length_q=seq), device)
    attention_rate = 4 * patches * seq * d / attention_s
    matmul, attention = flops_by_kind(config, grid)
    return 1 / (matmul / matmul_rate + attention / attention_rate), matmul_rate / 1e12, attention_rate / 1e12


def device_seconds(fn, device: torch.device | str = "cuda", repeat: int = 10) -> float:
    """Seconds of one call of `fn` on `device` (after a warm-up, mean of `repeat`)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def cuda_rows(args) -> dict:
    tower = FullSizeTower(torch.bfloat16, args.vit_attention)
    results = {"queued_bytes_per_1024_image": queued_bytes_per_1024_image(tower)}
    print(f"queued bytes per 1024^2 image: {results['queued_bytes_per_1024_image']}")
    for side in (448, 1024):
        items = [tower.plan(MediaItem(MediaKind.IMAGE, (image_bytes(side, side, 7_000 + k),)))
                 for k in range(args.cuda_items)]
        grid = tower.preprocess(items[0]).layout
        batch = BatchConfig(max_batch_tokens=args.cuda_batch_tokens, max_batch_items=256, batch_wait_ms=args.wait_ms)
        # the whole burst queued at once: 64 uint8 1024^2 items are ~0.2 GB of pixels
        seconds, stats = asyncio.run(run_pool(tower, items, batch, args.workers, queued_bytes=8 << 30))
        torch.cuda.synchronize()
        # the device's own rate: forwards only, prepared once
        prepared = [tower.preprocess(i) for i in items[:16]]
        forward_s = device_seconds(lambda: tower.forward(prepared), repeat=3) / len(prepared)
        if side == 448:  # where the next change to the ViT starts
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                tower.forward(prepared)
                torch.cuda.synchronize()
            print(f"top kernels of one forward over {len(prepared)} images of 448^2:")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))
        flops = sum(flops_by_kind(tower.config, grid))
        tflops = flops / forward_s / 1e12
        mfu = tflops / args.peak_tflops
        best, matmul_tflops, attention_tflops = ceiling(tower.config, grid, len(prepared), torch.bfloat16,
                                                        torch.device("cuda"))
        results.update({f"cuda_{side}_images_per_s": len(items) / seconds,
                        f"cuda_{side}_forward_images_per_s": 1 / forward_s, f"cuda_{side}_forward_tflops": tflops,
                        f"cuda_{side}_mfu": mfu, f"cuda_{side}_ceiling_images_per_s": best,
                        f"cuda_{side}_frac_of_ceiling": 1 / forward_s / best,
                        f"cuda_{side}_ceiling_mfu": best * flops / 1e12 / args.peak_tflops,
                        f"cuda_{side}_matmul_tflops": matmul_tflops, f"cuda_{side}_attention_tflops": attention_tflops})
        print(f"cuda {side}^2 (grid {grid}): pool {len(items) / seconds:.1f} images/s end to end "
              f"({stats.forwards} forwards), forward alone {1 / forward_s:.1f} images/s, MFU {mfu:.1%}; "
              f"ceiling {best:.1f} images/s (MFU {results[f'cuda_{side}_ceiling_mfu']:.1%}: matmuls at "
              f"{matmul_tflops:.0f}, attention at {attention_tflops:.0f} TFLOP/s as measured), "
              f"forward at {results[f'cuda_{side}_frac_of_ceiling']:.0%} of it")
        if side == 448:  # what the token budget buys over one item per forward, same pool otherwise
            single = BatchConfig(max_batch_tokens=args.cuda_batch_tokens, max_batch_items=1, batch_wait_ms=0)
            single_s, _ = asyncio.run(run_pool(tower, items, single, args.workers, queued_bytes=8 << 30))
            results["cuda_448_single_images_per_s"] = len(items) / single_s
            results["cuda_448_budget_vs_single"] = single_s / seconds
            print(f"cuda 448^2 one image per forward: {len(items) / single_s:.1f} images/s "
                  f"(token budget {single_s / seconds:.2f}x)")
    return results


def graph_rows(tower: FullSizeTower, args) -> dict:
    what = tower._face.capture_graphs(tower.tower, args.cuda_batch_tokens, "tokens")
    graphs, results = tower._face.graphs, {}
    print(f"encoder graphs: {what}")
    if graphs is None:
        return results

    def ms(prepared, use: bool) -> float:
        tower._face.graphs = graphs if use else None
        return device_seconds(lambda: tower.forward(prepared), repeat=5) * 1000

    print(f"{'side':>5} {'items':>6} {'budget':>7} {'eager ms':>9} {'graph ms':>9} {'speedup':>8}")
    for side in (448, 1024):
        for count in (1, 4, 16):
            prepared = [tower.preprocess(tower.plan(MediaItem(MediaKind.IMAGE, (image_bytes(side, side, 9_000 + k),))))
                        for k in range(count)]
            if (layout := graphs.layout([p.layout for p in prepared])) is None:
                continue
            eager, graphed = ms(prepared, False), ms(prepared, True)
            results[f"cuda_graphs_{side}_x{count}_speedup"] = eager / graphed
            print(f"{side:>5} {count:>6} {layout.budget:>7} {eager:>9.2f} {graphed:>9.2f} {eager / graphed:>7.2f}x")
    tower._face.graphs = None
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint for the CPU table (default: tiny Qwen2-VL)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--items", type=int, default=96)
    p.add_argument("--scale", type=float, default=0.25, help="image side scale for the tiny model")
    p.add_argument("--workers", type=int, default=2, help="preprocessing threads")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--count-batch", type=int, default=8, help="@serve.batch max_batch_size")
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--vit-attention", choices=("packed", "loop"), default="packed",
                   help="packed: one attention call per layer per batch; loop: one per item (transformers)")
    p.add_argument("--cuda-items", type=int, default=64)
    p.add_argument("--cuda-batch-tokens", type=int, default=16384)
    p.add_argument("--graphs", action="store_true",
                   help="with --device cuda: only encoder CUDA graphs vs eager per budget")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    # CUDA: the full-size tower alone (the GPU machine has no Ray for the CPU table's @serve.batch row)
    if args.device == "cuda" and args.graphs:
        result = graph_rows(FullSizeTower(torch.bfloat16, args.vit_attention), args)
    else:
        result = cuda_rows(args) if args.device == "cuda" else cpu_table(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
