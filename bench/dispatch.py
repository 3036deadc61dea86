"""How the router hands embeddings to the LLM: pending refs (default) vs awaiting them first.

DESIGN.md leaves the choice to measurement. Two apps run side by side on one Serve instance,
identical but for `await_embeddings_in_router`; requests alternate between them (same images,
the encoder cache off), and the time to the first streamed token is compared.

    python bench/dispatch.py [--requests 40] [--model DIR]

Last line: one JSON object with `pass_refs_ttft_p50_ms`, `await_ttft_p50_ms`, `await_vs_pass_refs`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from deployments.cli.bench_app import start_serve, stop_app
from mmserve.loadgen.dataset import data_uri, image_bytes

MODES = {"pass_refs": False, "await": True}


def _ttft_ms(url: str, image: bytes) -> float:
    body = {
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_uri(image)}}, {"type": "text", "text": "Describe."}]}],
        "max_tokens": 2, "stream": True,
    }
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            token = line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line
            if token or '"finish_reason": "' in line:
                return (time.perf_counter() - start) * 1000
    raise RuntimeError("stream ended without a token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="measured requests per mode")
    parser.add_argument("--model", default=None, help="checkpoint (default: the tiny Qwen2-VL)")
    parser.add_argument("--image-size", type=int, default=224)
    ns = parser.parse_args()

    from mmserve.tiny import ensure_tiny_model

    model = ns.model or str(ensure_tiny_model())
    small = {"num_cpus": 0.1}
    port, _ = start_serve(4, apps={mode: {
        "model": model, "served_model_name": mode, "router": small, "encoder": small, "llm": small,
        "encoder_pool": {"cache_bytes": 0, "batch_wait_ms": 0}, "await_embeddings_in_router": awaits}
        for mode, awaits in MODES.items()})
    urls = {mode: f"http://127.0.0.1:{port}/{mode}" for mode in MODES}

    images = [image_bytes(ns.image_size, ns.image_size, seed) for seed in range(ns.requests + 4)]
    for mode in MODES:  # warm-up
        for image in images[:4]:
            _ttft_ms(urls[mode], image)
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i, image in enumerate(images[4:]):
        order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
        for mode in order:
            samples[mode].append(_ttft_ms(urls[mode], image))
    stop_app()

    p50 = {mode: statistics.median(v) for mode, v in samples.items()}
    mean = {mode: statistics.fmean(v) for mode, v in samples.items()}
    print(f"{'hand-off':<12}{'TTFT p50 ms':>14}{'TTFT mean ms':>14}")
    for mode in MODES:
        print(f"{mode:<12}{p50[mode]:>14.1f}{mean[mode]:>14.1f}")
    ratio = p50["await"] / p50["pass_refs"]
    print(f"await / pass_refs (p50): {ratio:.3f}")
    print(json.dumps({
        "requests_per_mode": ns.requests, "image_size": ns.image_size,
        "pass_refs_ttft_p50_ms": round(p50["pass_refs"], 2), "await_ttft_p50_ms": round(p50["await"], 2),
        "pass_refs_ttft_mean_ms": round(mean["pass_refs"], 2), "await_ttft_mean_ms": round(mean["await"], 2),
        "await_vs_pass_refs": round(ratio, 3),
    }))


if __name__ == "__main__":
    main()
