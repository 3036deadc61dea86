"""A real-size checkpoint, loaded and served (CPU): `python bench/load.py [--quantization Q] [--tiny] [--serve]`.

Builds (once) a random Qwen2-VL-2B-Instruct checkpoint (`mmserve.loadgen.checkpoints.qwen2_vl_2b`,
bf16 on disk, 2.2B parameters) and loads it, each in a fresh process, as an LLM replica does
(`llm_service.model.language_model.LanguageModel`: the language model only), as an encoder replica does
(`encoder_service.runtime.VisionEncoder`: the vision tower only), and as `transformers` does
(`from_pretrained` of the whole model), in each dtype asked for. For each: the weights' bytes in
memory, the peak growth of the process's resident memory while loading (Linux VmHWM, reset just
before the load, minus the RSS then), their ratio, and the seconds. The target of the issue that
made this bench: an mmserve half at <= 1.3x its weights. About 0.2 GB of that growth is paid once
by any process that loads (the model classes' imports, ...): `--warm` loads again in the same
process after the first load is dropped (and glibc's freed pages trimmed) and reports that peak too.

`--quantization fp8-block | fp8-channel | awq`: the same checkpoint with its language model's
projections in that published format (`mmserve.tiny.quantized`, blocks / groups of 128 as released,
built once, tensor by tensor); the weights' bytes are then those held: quantized weights and their
scales as stored, embeddings and the vision tower in the load dtype, and the `quantized` column says
how many of them are the quantized tensors. `transformers` is left out of the default roles there (its
quantized loaders need packages mmserve does not depend on: `accelerate` for FP8). `--tiny`: the tiny Qwen2-VL instead (`mmserve
build-tiny-model`, float32; `--quantization` applies): its weights are under a megabyte, so its
peak is the fixed cost of a load (imports, module objects), not a multiple of its weights.

`--serve` then starts the app on the checkpoint (one Encoder, one LLM replica, the node's CPUs)
and times `--requests` chat completions of the same shape one after another (two fresh
`--image-size` images each, `--max-tokens` tokens, greedy, EOS ignored), then the same requests
through `transformers`' `generate` in this process (the app stopped first): the first served
request against the second (warm-up), and served against `generate`, request by request. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLES = ("llm", "encoder", "transformers")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


QUANTIZED = ("weight_scale_inv", "weight_scale", "qweight", "qzeros", "scales")  # + FP8 `weight`s


def _size(gb: float) -> str:
    return f"{gb:6.3f} GB" if gb >= 0.01 else f"{gb * 1e3:6.3f} MB"


def _param_bytes(module) -> tuple[int, int]:
    """(bytes of `module`'s parameters, of those the quantized tensors: FP8 / int4 weights and their scales)."""
    import torch

    storages = {}
    for name, p in module.named_parameters():
        quantized = name.rpartition(".")[2] in QUANTIZED or p.dtype == torch.float8_e4m3fn
        storages[p.untyped_storage().data_ptr()] = (p.numel() * p.element_size(), quantized)
    return sum(n for n, _ in storages.values()), sum(n for n, q in storages.values() if q)


def child(role: str, dtype: str, model_dir: str, warm: bool = False) -> dict:
    """One load in this (fresh) process; `warm`: then a second one, after the first is dropped."""
    import ctypes
    import gc

    import torch  # noqa: F401  (imported before the baseline RSS, as every role needs it)
    from transformers import AutoModelForImageTextToText

    from encoder_service.runtime import VisionEncoder
    from llm_service.model.language_model import LanguageModel

    def load():
        rss = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        if role == "llm":
            module = LanguageModel(model_dir, dtype=dtype).modules
        elif role == "encoder":
            module = VisionEncoder(model_dir, dtype=dtype).tower
        else:
            module = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        return module, _status("VmHWM") - rss, time.perf_counter() - start

    module, peak, seconds = load()
    weights, quantized = _param_bytes(module)
    out = {"role": role, "dtype": dtype, "weights_gb": weights / 1e9, "quantized_gb": quantized / 1e9,
           "peak_growth_gb": peak / 1e9, "peak_over_weights": peak / weights, "seconds": seconds}
    if warm:
        del module
        gc.collect()
        ctypes.CDLL(None).malloc_trim(0)  # glibc keeps freed heap pages resident: the second load would reuse them
        _, peak, _ = load()
        out.update(warm_peak_growth_gb=peak / 1e9, warm_peak_over_weights=peak / weights)
    return out


def _messages(seed: int, size: int, as_api: bool) -> list[dict]:
    from mmserve.loadgen.dataset import ImageSpec, data_uri, synthesize_image

    images = [synthesize_image(ImageSpec(size, size, seed * 2 + i)) for i in range(2)]
    parts = [{"type": "image_url", "image_url": {"url": data_uri(d)}} if as_api else {"type": "image", "bytes": d}
             for d in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Compare these two pictures."}]}]


def served_seconds(model: str, dtype: str, requests: int, size: int, max_tokens: int,
                   threads: int | None) -> list[float]:
    import os

    import httpx

    from deployments.cli.bench_app import start_app, stop_app

    url, _ = start_app(model, colocated=False, num_cpus=len(os.sched_getaffinity(0)), dtype=dtype, cpu_threads=threads)
    try:
        seconds = []
        for seed in range(requests):
            body = {"model": "bench", "messages": _messages(seed, size, True), "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True}
            start = time.perf_counter()
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
            resp.raise_for_status()
            seconds.append(time.perf_counter() - start)
            assert resp.json()["usage"]["completion_tokens"] == max_tokens
        return seconds
    finally:
        stop_app()


def generate_seconds(model_dir: str, dtype: str, requests: int, size: int, max_tokens: int) -> list[float]:
    import io

    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    seconds = []
    for seed in range(requests):
        messages = _messages(seed, size, False)
        images = [Image.open(io.BytesIO(p["bytes"])).convert("RGB") for p in messages[0]["content"] if "bytes" in p]
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": messages[0]["content"][-1]["text"]}]}]
        start = time.perf_counter()
        inputs = processor(text=[processor.apply_chat_template(chat, add_generation_prompt=True)], images=images,
                           return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        seconds.append(time.perf_counter() - start)
        assert out.shape[1] - inputs["input_ids"].shape[1] == max_tokens
    return seconds


def checkpoint(args) -> str:
    """The checkpoint `args` ask for, built once in the temporary directory."""
    if args.tiny:
        from mmserve.tiny import build_tiny_model

        out = Path(tempfile.gettempdir()) / f"mmserve-bench-tiny-qwen2_vl-{args.quantization or 'dense'}"
        if not (out / "mmserve_tiny.json").exists():
            print(f"[load] building the tiny Qwen2-VL checkpoint in {out}", flush=True)
            build_tiny_model("qwen2_vl", out, quantization=args.quantization)
        return str(out)
    from mmserve.loadgen.checkpoints import qwen2_vl_2b

    name = f"mmserve-bench-qwen2_vl_2b-{args.text_layers or 'all'}-{args.vision_depth or 'all'}"
    if args.quantization:
        name += f"-{args.quantization}"
    print(f"[load] building (once) the random Qwen2-VL-2B checkpoint in {tempfile.gettempdir()}/{name}", flush=True)
    return qwen2_vl_2b(Path(tempfile.gettempdir()) / name, text_layers=args.text_layers,
                       vision_depth=args.vision_depth, quantization=args.quantization)


def main() -> None:
    from mmserve.tiny.quantized import QUANTIZATIONS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint to load (default: build the random Qwen2-VL-2B)")
    parser.add_argument("--text-layers", type=int, help="shrink the built checkpoint's language model")
    parser.add_argument("--vision-depth", type=int, help="shrink the built checkpoint's vision tower")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="the built checkpoint's language model in "
                        "this published format (blocks / groups of 128)")
    parser.add_argument("--tiny", action="store_true", help="build the tiny Qwen2-VL instead of the 2B")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated load dtypes")
    parser.add_argument("--roles", help=f"comma-separated, of {', '.join(ROLES)} (default: all; llm,encoder "
                        "with --quantization)")
    parser.add_argument("--serve", action="store_true", help="then serve it, against transformers' generate")
    parser.add_argument("--serve-dtype", default="float32", help="the dtype --serve runs in")
    parser.add_argument("--requests", type=int, default=3, help="--serve: requests, one after another")
    parser.add_argument("--image-size", type=int, default=224, help="--serve: each request's two images (square)")
    parser.add_argument("--max-tokens", type=int, default=16, help="--serve: tokens per request")
    parser.add_argument("--cpu-threads", type=int, help="--serve: the model replicas' torch threads (default: "
                        "the app's policy)")
    parser.add_argument("--warm", action="store_true", help="each load again in the same process after the "
                        "first is dropped: the peak without the imports and other costs a process pays once")
    parser.add_argument("--child", nargs=3, metavar=("ROLE", "DTYPE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, warm=args.warm)))
        return
    model = args.model or checkpoint(args)
    roles = args.roles or ",".join(ROLES[:2] if args.quantization else ROLES)
    rows = []
    for dtype in args.dtypes.split(","):
        for role in roles.split(","):
            out = subprocess.run([sys.executable, __file__, "--child", role, dtype, model,
                                  *(["--warm"] if args.warm else [])], capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"{role} {dtype} failed:\n{out.stderr[-3000:]}")
            rows.append(r := json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{r['role']:>12} {r['dtype']:>9}  weights {_size(r['weights_gb'])} (quantized "
                  f"{_size(r['quantized_gb'])})  peak +{_size(r['peak_growth_gb'])}  {r['peak_over_weights']:5.2f}x"
                  f"  {r['seconds']:6.1f}s" + (f"  warm +{_size(r['warm_peak_growth_gb'])} "
                                              f"{r['warm_peak_over_weights']:5.2f}x" if args.warm else ""), flush=True)
    worst = max(r["peak_over_weights"] for r in rows if r["role"] != "transformers")
    print(f"worst mmserve half: peak {worst:.2f}x its weights (target <= 1.3x"
          f"{'; the tiny: a load costs a process ~0.2 GB once, whatever its weights' if args.tiny else ''})")
    result = {"model": model, "quantization": args.quantization, "rows": rows,
              "worst_mmserve_peak_over_weights": worst}
    if args.serve:
        shape = (args.serve_dtype, args.requests, args.image_size, args.max_tokens)
        served = served_seconds(model, *shape, args.cpu_threads)
        reference = generate_seconds(model, *shape)
        print(f"{'request':>8} {'served s':>9} {'generate s':>11} {'ratio':>6}")
        for i, (a, b) in enumerate(zip(served, reference)):
            print(f"{i + 1:>8} {a:9.2f} {b:11.2f} {a / b:6.2f}")
        warm = served[1:] or served
        ratio = sum(warm) / sum(reference[1:] or reference)
        first = served[0] / (sum(warm) / len(warm))
        print(f"served / generate (after the first): {ratio:.2f} (target <= 1.3); "
              f"first served request / the later ones: {first:.2f} (target 0.8-1.2)")
        result.update(served_s=served, generate_s=reference, served_over_generate=ratio, first_over_later=first,
                      serve_shape=dict(zip(("dtype", "requests", "image_size", "max_tokens"), shape)),
                      cpu_threads=args.cpu_threads)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
