"""Embedding transfer and ingress overhead, side by side (CPU, a few minutes): `python bench/transfer.py`.

1. Moving 0.8 / 4 / 20 MB embeddings (bf16 and fp16) from an encoder actor to an LLM actor:
   by the object store (the encoder returns the tensor, the LLM gets it through a ref it did not
   create, as with Serve) and by gRPC (the encoder publishes, the LLM fetches by hash).
   Latency p50/p99 and MB/s per size.
2. End-to-end overhead of the gRPC ingress versus HTTP: a small text request (max_tokens=1)
   against the same Serve app, p50/p99 per protocol.
3. Embedding bytes per 448x448 image, Qwen2-VL vs Qwen3-VL (published full-size configs; rows
   from the router's sizing rule, DeepStack parts included) and the transfer time of one such
   output (random bf16 parts) over both transports.
The last line printed is one JSON object with all figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch

from deployments.cli.ingress_modes import free_loopback_port
from deployments.cli.ray_head import HeadSpec, start_head

SIZES_MB = (0.8, 4.0, 20.0)
HIDDEN = 2048


def _percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


@ray.remote(num_cpus=0)
class Encoder:
    def __init__(self):
        from deployments.config import GrpcArgs
        from deployments.serve.transport import GrpcPublisher

        self.publisher = GrpcPublisher(GrpcArgs(bind_host="127.0.0.1", token="bench"), host="127.0.0.1")

    def tensor(self, mb: float, dtype: str, seed: int) -> torch.Tensor:
        rows = max(1, int(mb * 1e6 / (HIDDEN * 2)))
        return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(getattr(torch, dtype))

    def embedding(self, shape: tuple[int, int, int], seed: int):
        """An `ItemEmbedding` of `parts` x `rows` x `hidden` random bf16 values."""
        from mmserve.inputs.embeddings import ItemEmbedding

        parts, rows, hidden = shape
        gen = torch.Generator().manual_seed(seed)
        return ItemEmbedding(tuple(torch.randn(rows, hidden, generator=gen).to(torch.bfloat16) for _ in range(parts)),
                             key=f"family-{shape}-{seed}")

    def publish(self, what: str, *args):
        """What `self.<what>(*args)` makes (a tensor: one part), published for gRPC fetches."""
        from mmserve.inputs.embeddings import ItemEmbedding
        from mmserve.inputs.media import EncodeItem, MediaItem, MediaKind

        made, key = getattr(self, what)(*args), f"{what}-{args}"
        embedding = made if isinstance(made, ItemEmbedding) else ItemEmbedding((made,), key=key)
        item = EncodeItem(MediaItem(MediaKind.IMAGE, (key.encode(),)), None, 0)
        return self.publisher.publish([item], [embedding])[0]


@ray.remote(num_cpus=0)
class LLM:
    def __init__(self):
        from deployments.config import GrpcArgs
        from deployments.serve.transport import GrpcFetcher

        self.fetcher = GrpcFetcher(GrpcArgs(token="bench"))

    async def receive(self, refs: list) -> tuple[float, int]:
        """Seconds to materialise the tensor behind `refs[0]` (an ObjectRef), and its byte count."""
        start = time.perf_counter()
        got = await refs[0]
        seconds = time.perf_counter() - start
        return seconds, got.num_bytes if hasattr(got, "num_bytes") else got.numel() * got.element_size()

    async def fetch(self, ref) -> tuple[float, int]:
        start = time.perf_counter()
        embedding = await self.fetcher.fetch(ref)
        return time.perf_counter() - start, embedding.num_bytes


def timed(encoder, llm, transport: str, what: str, args: tuple, iters: int) -> tuple[float, float, int]:
    """(p50 ms, p99 ms, bytes) of `iters` transfers (after 2 warm-ups) of what `encoder.<what>(*args, i)` makes,
    by `transport`: the object store (a ref the LLM did not create) or gRPC (published, fetched by hash)."""
    times, nbytes = [], 0
    for i in range(iters + 2):
        if transport == "object_store":
            ref = getattr(encoder, what).remote(*args, i)  # owned by the driver, like Serve's router
            ray.wait([ref])
            seconds, nbytes = ray.get(llm.receive.remote([ref]))
            del ref
        else:
            seconds, nbytes = ray.get(llm.fetch.remote(ray.get(encoder.publish.remote(what, *args, i))))
        if i >= 2:
            times.append(seconds * 1000)
    return *_percentiles(times), nbytes


def bench_transfer(iters: int) -> dict:
    encoder, llm = Encoder.remote(), LLM.remote()
    results = {}
    for mb in SIZES_MB:
        for dtype in ("bfloat16", "float16"):
            for transport in ("object_store", "grpc"):
                p50, p99, nbytes = timed(encoder, llm, transport, "tensor", (mb, dtype), iters)
                results[(mb, dtype, transport)] = {
                    "p50_ms": round(p50, 2), "p99_ms": round(p99, 2),
                    "mb_s": round(nbytes / 1e6 / (p50 / 1000), 1), "bytes": nbytes,
                }
    return results


IMAGE_SIDE = 448


def family_configs() -> dict:
    """Published full-size configs (hub config.json values that size the encoder output)."""
    from transformers import Qwen2VLConfig, Qwen3VLConfig

    def qwen3(hidden: int):
        return Qwen3VLConfig(text_config={"hidden_size": hidden},
                             vision_config={"out_hidden_size": hidden, "deepstack_visual_indexes": [8, 16, 24]})

    return {
        "qwen2_vl_7b": Qwen2VLConfig(),  # defaults are Qwen2-VL-7B's: merger to 3584, 14-px patches
        "qwen3_vl_4b": qwen3(2560),
        "qwen3_vl_8b": qwen3(4096),
    }


def output_shape(config) -> tuple[int, int, int]:
    """(parts, rows, hidden) of one 448x448 image's encoder output under `config`."""
    from mmserve.families.qwen2_vl import VisionPreprocessConfig, image_grid, tokens_for_grid

    vision = config.vision_config
    merge = vision.spatial_merge_size
    if config.model_type == "qwen3_vl":  # Qwen3-VL's image processor bounds
        cfg = VisionPreprocessConfig(patch_size=vision.patch_size, merge_size=merge,
                                     min_pixels=65536, max_pixels=16777216)
        parts, hidden = 1 + len(vision.deepstack_visual_indexes), vision.out_hidden_size
    else:
        cfg = VisionPreprocessConfig(patch_size=vision.patch_size, merge_size=merge)
        parts, hidden = 1, vision.hidden_size
    rows = tokens_for_grid(image_grid(IMAGE_SIDE, IMAGE_SIDE, cfg), merge)
    return parts, rows, hidden


def bench_families(iters: int) -> dict:
    encoder, llm = Encoder.remote(), LLM.remote()
    out = {}
    for name, config in family_configs().items():
        shape = output_shape(config)
        entry = {"parts": shape[0], "rows": shape[1], "hidden": shape[2], "bytes_bf16": 2 * shape[0] * shape[1] * shape[2]}
        for transport in ("object_store", "grpc"):
            p50, p99, nbytes = timed(encoder, llm, transport, "embedding", (shape,), iters)
            assert nbytes == entry["bytes_bf16"]
            entry[transport] = {"p50_ms": round(p50, 2), "p99_ms": round(p99, 2)}
        out[name] = entry
    return out


def bench_ingress(iters: int) -> dict:
    import httpx
    from ray import serve

    from deployments.serve.app import build_app
    from deployments.serve.router import grpc_options
    from mmserve.rpc.vlm_client import VLMClient, user

    http_port, grpc_port = free_loopback_port(), free_loopback_port()
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, grpc_options=grpc_options(port=grpc_port))
    small = {"num_cpus": 0.1}
    serve.run(build_app({"router": small, "encoder": small, "llm": small}), name="bench", route_prefix="/")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    url = f"http://127.0.0.1:{http_port}/v1/chat/completions"
    out = {}
    with httpx.Client(timeout=60) as http, VLMClient(f"127.0.0.1:{grpc_port}") as grpc_client:
        calls = {
            "http": lambda: http.post(url, json=body).raise_for_status(),
            "grpc": lambda: grpc_client.generate([user("hi")], max_tokens=1),
        }
        for name, call in calls.items():
            for _ in range(3):
                call()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                call()
                times.append((time.perf_counter() - start) * 1000)
            out[name] = _percentiles(times)
    serve.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20, help="timed transfers per size, dtype and transport")
    parser.add_argument("--ingress-iters", type=int, default=50)
    parser.add_argument("--families-only", action="store_true", help="only section 3 (per-family output sizes)")
    ns = parser.parse_args()
    head = start_head(HeadSpec(num_cpus=4))  # Ray as every entry point starts it (deployments/cli/ray_head.py)
    try:
        families = bench_families(ns.iters)
        transfer = ingress = None
        if not ns.families_only:
            transfer = bench_transfer(ns.iters)
            ingress = bench_ingress(ns.ingress_iters)
    finally:
        head.stop()

    print(f"{'448x448 image':>14} | {'parts x rows x hidden':>22} {'MB bf16':>8} | "
          f"{'object store p50/p99 ms':>24} | {'gRPC p50/p99 ms':>18}")
    for name, f in families.items():
        o, g = f["object_store"], f["grpc"]
        print(f"{name:>14} | {f['parts']:>6} x {f['rows']:>5} x {f['hidden']:>5} {f['bytes_bf16'] / 1e6:>8.2f} | "
              f"{o['p50_ms']:>11.2f} / {o['p99_ms']:>10.2f} | {g['p50_ms']:>8.2f} / {g['p99_ms']:>7.2f}")
    if ns.families_only:
        print(json.dumps({"families_448px": families}))
        return

    print(f"{'size':>6} {'dtype':>9} | {'object store p50/p99 ms':>24} {'MB/s':>8} | {'gRPC p50/p99 ms':>18} {'MB/s':>8}")
    for mb in SIZES_MB:
        for dtype in ("bfloat16", "float16"):
            o, g = transfer[(mb, dtype, "object_store")], transfer[(mb, dtype, "grpc")]
            print(f"{mb:>4} MB {dtype:>9} | {o['p50_ms']:>11.2f} / {o['p99_ms']:>10.2f} {o['mb_s']:>8.1f} | "
                  f"{g['p50_ms']:>8.2f} / {g['p99_ms']:>7.2f} {g['mb_s']:>8.1f}")
    for name, (p50, p99) in ingress.items():
        print(f"ingress {name:>4}: p50 {p50:.2f} ms, p99 {p99:.2f} ms (text, max_tokens=1)")
    summary = {
        "object_store_mb_s_20mb": transfer[(20.0, "bfloat16", "object_store")]["mb_s"],
        "grpc_mb_s_20mb": transfer[(20.0, "bfloat16", "grpc")]["mb_s"],
        "object_store_p50_ms_4mb": transfer[(4.0, "bfloat16", "object_store")]["p50_ms"],
        "grpc_p50_ms_4mb": transfer[(4.0, "bfloat16", "grpc")]["p50_ms"],
        "transfer": {f"{t}_{d}_{mb}mb": v for (mb, d, t), v in transfer.items()},
        "ingress_http_p50_ms": round(ingress["http"][0], 2),
        "ingress_grpc_p50_ms": round(ingress["grpc"][0], 2),
        "ingress_grpc_minus_http_p50_ms": round(ingress["grpc"][0] - ingress["http"][0], 2),
        "families_448px": families,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
