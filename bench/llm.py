"""LLM engine vs `transformers` generate: output tokens/s and inter-token latency at concurrency 1, 8, 32.

    python bench/llm.py                      # CPU, a small random Qwen2-VL LM, a few minutes
    python bench/llm.py --device cuda        # full-size Qwen2-VL-2B LM config (random weights)
    python bench/llm.py --device cuda --no-split-kv   # the same without split-K decode (compare the 8k row)
    python bench/llm.py --device cuda --breakdown [--no-fused-ops]   # kernels per step with / without fusion
    python bench/llm.py --hybrid-prefix      # hybrid LM: TTFT with state snapshots on vs off
    python bench/llm.py --hybrid-prefix --quick    # the same, smaller prompt (seconds)
    python bench/llm.py --breakdown          # per-step time by phase, overlap off and on
    python bench/llm.py --grammar [--device cuda] [--overlap on|off]   # step time, a JSON-schema grammar on every row
    python bench/llm.py --lora [--device cuda] [--lora-rounds 3]   # decode at batch 32: 4 LoRA adapters vs the base
    python bench/llm.py --moe [--quick] [--dtype float32] [--device cuda]   # one MoE layer (bench/moe.py)
    python bench/llm.py --tensor-parallel-size 2 [--quick] [--device cuda]   # TP 2 vs TP 1 (bench/llm_tp.py)
    python bench/llm.py --quantization fp8-block [--device cuda]   # decode b1 / b64, quantized LM vs dense

(a) `generate` serves the requests one at a time (what a replica without batching does);
(b) the engine gets all of them at once. The last line printed is one JSON object.
Then steady decode (every sequence past its prefill): ms per step at batch 1 and 64, and (CUDA) at
batch 4 over 8k-token contexts, with what bounds them (weight bytes, KV bytes per token); with
--device cuda also batch-1 against the weight-bandwidth bound (weight bytes / HBM bandwidth).
bench/gpu_report.py turns these into ratios to the physical limits.

--hybrid-prefix: a Gated-DeltaNet hybrid LM (`qwen3_5_text` in a MiniCPM-V 4.6 shell, hidden 256,
8 layers: 6 linear-attention + 2 full-attention, random weights) serves two requests that share
a system prompt (1,024 tokens) and an image (256 placeholder tokens, random embedding rows under
one media key) and differ in a 16-token question; the TTFT of the second one is measured with
state snapshots on (prefix caching resumes it) and off (the whole prompt is computed again).

--breakdown: where an engine step's time goes, by phase, overlapped and not: docs/benchmarks.md#components.

--grammar (structured outputs' cost: a JSON-schema grammar on every row against none) and --lora (LoRA
adapters mixed in a decode batch against the base model): docs/benchmarks.md#components.

--moe (one MoE layer: bench/moe.py) runs that script in this process's place with the other arguments.

--quantization fp8-block|fp8-channel|awq: the random LM (Qwen2-VL-2B's on CUDA, bf16; the small one on
CPU, float32) and the same weights quantized by the format's own rule (`mmserve.tiny.quantized`, the
released settings: 128 x 128 blocks, AWQ groups of 128), each on its own engine in turn: steady decode
ms per step at batch 1 and 64, each against its bound (the side's weight bytes as held + the KV bytes a
step reads, at the device's peak memory bandwidth), and the quantized step over the dense one
(`quantized_b64_step_ratio`: FP8's target is <= 0.7 on an H100/H200). `gemm` says which GEMM the
quantized side ran (`llm_service.model.quantized_gemm`: the kernels on CUDA, the dequantizing path on
the CPU or with MMSERVE_QUANTIZED_GEMM=dequantize).

--tensor-parallel-size N (TP N against TP 1: bench/llm_tp.py) runs that script with every argument.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine, LLMRequest
from llm_service.engine.sequence import LoraRequest
from llm_service.model.kv_cache import bytes_per_block
from llm_service.model.language_model import LanguageModel
from llm_service.sampling import Grammar, SamplingParams
from mmserve.loadgen.checkpoints import random_lm
from mmserve.loadgen.device_peaks import peaks
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import PlaceholderRange

# the --hybrid-prefix LM: 3 linear-attention layers per full-attention layer, like Qwen3.5's
HYBRID_TEXT = dict(model_type="qwen3_5_text", hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=32, linear_num_key_heads=4,
                   linear_key_head_dim=64, linear_num_value_heads=8, linear_value_head_dim=64,
                   vocab_size=4096, max_position_embeddings=8192, eos_token_id=2, pad_token_id=0)
IMAGE_TOKEN = 5
# (system prompt, image placeholder, question) tokens
HYBRID_SIZES = {"full": (1024, 256, 16), "quick": (256, 64, 16)}


def removed_at_exit(path: Path) -> Path:
    atexit.register(shutil.rmtree, path, True)
    return path


def random_checkpoint(args) -> Path:
    """`--model`, else a random Qwen2-VL (`random_lm`: small on CPU, Qwen2-VL-2B's LM on CUDA), removed at exit."""
    if args.model:
        return Path(args.model)
    return removed_at_exit(random_lm("small" if args.device == "cpu" else "2b", dtype_for(args.device), args.device))


def dtype_for(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


def language_model(model_dir: Path, device: str) -> LanguageModel:
    return LanguageModel(model_dir, dtype=str(dtype_for(device)).removeprefix("torch."), device=device)


def hybrid_checkpoint() -> Path:
    """A MiniCPM-V 4.6 checkpoint with the `HYBRID_TEXT` LM (tiny vision tower), random weights."""
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=112,
                  patch_size=14, insert_layer_id=1)
    config = MiniCPMV4_6Config(text_config=HYBRID_TEXT, vision_config=vision, insert_layer_id=1,
                               image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1)
    torch.manual_seed(0)
    out = removed_at_exit(Path(tempfile.mkdtemp(prefix="mmserve-bench-hybrid-")))
    MiniCPMV4_6ForConditionalGeneration(config).save_pretrained(out)
    return out


def hybrid_requests(tag: str, sizes: tuple[int, int, int], vocab: int, hidden: int, seed: int):
    """Two requests sharing a system prompt and an image (distinct per `seed`), other questions."""
    system_len, image_len, question_len = sizes
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(10, vocab, (system_len,), generator=g).tolist()
    image = ItemEmbedding((torch.randn(image_len, hidden, generator=g),), key=f"bench-image-{seed}")
    questions = [torch.randint(10, vocab, (question_len,), generator=g).tolist() for _ in range(2)]
    # snapshot_boundaries: where the router says the system prompt ends
    return [LLMRequest(f"{tag}-{seed}-{i}", tuple(system + [IMAGE_TOKEN] * image_len + question),
                       SamplingParams(max_tokens=2, ignore_eos=True),
                       media=((PlaceholderRange(system_len, image_len), image),), snapshot_boundaries=(system_len,))
            for i, question in enumerate(questions)]


def ttft(engine: LLMEngine, request: LLMRequest) -> float:
    """Seconds from `add_request` to the first token (the request runs to its end)."""
    first, done = [], threading.Event()

    def on_event(ev):
        if not first:
            first.append(time.perf_counter())
        if ev.finish_reason:
            done.set()

    start = time.perf_counter()
    engine.add_request(request, on_event)
    done.wait()
    return first[0] - start


def bench_hybrid_prefix(args) -> None:
    lm = LanguageModel(hybrid_checkpoint(), dtype="float32")
    sizes = HYBRID_SIZES["quick" if args.quick else "full"]
    hidden, vocab = lm.text_config.hidden_size, lm.vocab_size
    result: dict[str, float | str] = {"device": "cpu", "model": "qwen3_5_text h256 8L (6 linear : 2 full)",
                                      "system_tokens": sizes[0], "image_tokens": sizes[1], "question_tokens": sizes[2]}
    rows = {}
    for name, share in (("off", 0.0), ("on", EngineConfig.state_snapshot_share)):
        engine = LLMEngine(lm, EngineConfig(max_num_batched_tokens=2048, state_snapshot_share=share))
        engine.start()
        warm = LLMRequest(f"warm-{name}", tuple(range(10, 26)), SamplingParams(max_tokens=2, ignore_eos=True))
        ttft(engine, warm)  # first-forward costs (one block, nothing to cache)
        firsts, seconds = [], []
        cached = engine.stats().num_cached_tokens
        for k in range(args.repeats):
            first, second = hybrid_requests(name, sizes, vocab, hidden, k)
            firsts.append(ttft(engine, first))
            seconds.append(ttft(engine, second))
        stats = engine.stats()
        engine.shutdown()
        rows[name] = (statistics.median(firsts), statistics.median(seconds),
                      (stats.num_cached_tokens - cached) // args.repeats, stats)
        if engine.scheduler.snapshots is not None:
            result["snapshot_budget_mb"] = round(engine.runner.states.snapshot_bytes / 2**20, 1)
    off, on = rows["off"], rows["on"]
    prompt = sum(sizes)
    print(f"{'snapshots':>9} {'1st TTFT ms':>12} {'2nd TTFT ms':>12} {'2nd cached tok':>15} {'2nd computed tok':>17}")
    for name, (t1, t2, cached, _) in rows.items():
        print(f"{name:>9} {t1 * 1000:>12.1f} {t2 * 1000:>12.1f} {cached:>15} {prompt - cached:>17}")
    speedup = off[1] / on[1]
    snapshot_mb = on[3].snapshot_bytes / 2**20
    print(f"2nd-request TTFT speedup {speedup:.2f}x; {on[3].num_snapshots} snapshots held ({snapshot_mb:.2f} MiB), "
          f"{on[3].num_snapshot_resumes} resumes")
    result.update({"ttft_first_ms_off": round(off[0] * 1000, 1), "ttft_first_ms_on": round(on[0] * 1000, 1),
                   "ttft_second_ms_off": round(off[1] * 1000, 1), "ttft_second_ms_on": round(on[1] * 1000, 1),
                   "cached_tokens_second_on": on[2], "hybrid_prefix_ttft_speedup": round(speedup, 2),
                   "snapshots": on[3].num_snapshots, "snapshot_mb": round(snapshot_mb, 3),
                   "snapshot_kib_each": round(on[3].snapshot_bytes / max(on[3].num_snapshots, 1) / 2**10, 1),
                   "repeats": args.repeats})
    print(json.dumps(result))


def prompts(n: int, length: int, vocab: int, seed: int = 1) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(10, vocab, (length,), generator=g).tolist()) for _ in range(n)]


def bench_generate(model, reqs, max_tokens, device) -> tuple[float, float]:
    """(tokens/s, mean inter-token ms) serving `reqs` one at a time with `generate`."""
    gaps, total, start = [], 0, time.perf_counter()
    for ids in reqs:
        times = []  # a streamer is what has put() and end()
        clock = SimpleNamespace(put=lambda value: times.append(time.perf_counter()), end=lambda: None)
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, streamer=clock)
        total += out.shape[1] - x.shape[1]
        t = times[1:]  # first put() is the prompt
        gaps += [b - a for a, b in zip(t, t[1:])]
    return total / (time.perf_counter() - start), 1000 * sum(gaps) / max(len(gaps), 1)


def run_engine(engine: LLMEngine, reqs, max_tokens, grammar: Grammar | None = None,
               loras: list[LoraRequest] | None = None) -> tuple[float, list[list[float]]]:
    """All of `reqs` submitted at once: (seconds until the last finished, each one's token times);
    with `loras`, request i runs under adapter `loras[i % len(loras)]`."""
    times: list[list[float]] = [[] for _ in reqs]
    done = [threading.Event() for _ in reqs]

    def emit(i):
        def on_event(ev):
            times[i].append(time.perf_counter())
            if ev.finish_reason:
                done[i].set()
        return on_event

    start = time.perf_counter()
    for i, ids in enumerate(reqs):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, grammar=grammar)
        lora = loras[i % len(loras)] if loras else None
        engine.add_request(LLMRequest(f"b{start}-{i}", tuple(ids), params, lora=lora), emit(i))
    for event in done:
        event.wait()
    return time.perf_counter() - start, times


def bench_engine(engine: LLMEngine, reqs, max_tokens) -> tuple[float, float]:
    """(tokens/s, mean inter-token ms) with all of `reqs` submitted at once."""
    elapsed, times = run_engine(engine, reqs, max_tokens)
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    return sum(len(t) for t in times) / elapsed, 1000 * sum(gaps) / max(len(gaps), 1)


def decode_ms_per_step(engine: LLMEngine, batch: int, context: int, tokens: int, vocab: int,
                       grammar: Grammar | None = None, loras: list[LoraRequest] | None = None) -> float:
    """Steady decode of `batch` sequences over `context`-token prompts: the mean gap between a
    sequence's tokens once every sequence has its first (no prefill chunk falls in a gap)."""
    _, times = run_engine(engine, prompts(batch, context, vocab), tokens, grammar, loras)
    steady = max(t[0] for t in times)
    gaps = [b - a for t in times for a, b in zip(t, t[1:]) if a >= steady]
    return 1000 * sum(gaps) / max(len(gaps), 1)


def decode_split_ms(engine: LLMEngine, batch: int, context: int, tokens: int, vocab: int,
                    grammar: Grammar | None = None) -> tuple[float, float, float]:
    """`decode_ms_per_step`, and the medians over its steady steps (`step_log`: the decode-only steps
    of the most sequences, all `batch` of them unless a short run on a busy host staggered their
    admission) of the forward's time (`launch`: on the CPU without overlap the forward runs there)
    and of the rest of `step()`."""
    engine.step_log = []
    try:
        ms = decode_ms_per_step(engine, batch, context, tokens, vocab, grammar)
        decode = [t for t in engine.step_log if t.decode_only]
        widest = max(t.num_seqs for t in decode)
        log = [t for t in decode if t.num_seqs == widest]
    finally:
        engine.step_log = None
    rest = statistics.median(t.schedule + t.prepare + t.sample + t.readback + t.postprocess for t in log)
    return ms, statistics.median(t.launch for t in log) * 1000, rest * 1000


# -- --grammar ------------------------------------------------------------------------------------
def bench_grammar(args) -> None:
    """Each of `--grammar-lm`'s shapes in turn (default: Qwen2-VL-2B's LM then the small one on CUDA,
    the small one on CPU); the first one's figures under the plain keys, the others' prefixed by
    their shape (`small_grammar_b64_step_ratio`)."""
    shapes = args.grammar_lm or (["small"] if args.device == "cpu" else ["2b", "small"])
    result: dict = {"device": args.device, "lm": shapes[0]}
    for i, shape in enumerate(shapes):
        print(f"--grammar, the {shape} LM:")
        result.update({(f"{shape}_" if i else "") + k: v for k, v in grammar_shape(args, shape).items()})
    print(json.dumps(result))


def grammar_shape(args, shape: str) -> dict:
    from mmserve.loadgen.grammar import SCHEMA
    from mmserve.loadgen.vocab import QWEN2_MODEL_VOCAB, qwen_size_tokenizer

    model_dir = removed_at_exit(random_lm(shape, dtype_for(args.device), args.device, QWEN2_MODEL_VOCAB))
    qwen_size_tokenizer().save_pretrained(model_dir)  # the grammar compiles for the checkpoint's tokenizer
    lm = language_model(model_dir, args.device)
    overlap = None if args.overlap is None else args.overlap == "on"
    engine = LLMEngine(lm, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096, async_scheduling=overlap,
                                        grammar_threads=args.grammar_threads))
    engine.start()
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    start = time.perf_counter()
    engine.grammars  # noqa: B018  the compiler: the tokenizer's token trie, llguidance's imports (once per replica)
    setup_ms = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    engine.grammars.compile(grammar)
    compile_ms = (time.perf_counter() - start) * 1000
    vocab, n = lm.vocab_size, args.decode_tokens
    bench_engine(engine, prompts(2, args.prompt_len, vocab), 4)  # warm up
    result: dict = {"vocab": vocab, "compiler_setup_ms": round(setup_ms, 1), "compile_ms": round(compile_ms, 1),
                    "decode_tokens": n, "overlap": engine.overlap, "fill_threads": engine.masks.threads}
    cpu = args.device == "cpu" and not engine.overlap  # the forward runs inside `step()`, apart from the rest
    print(f"{'batch':>5} {'none ms/step':>13} {'grammar ms/step':>16} {'ratio':>6} {'mask ms/step':>13}"
          f" {'fill ms/row':>12}"
          + (f" {'forward ms':>11} {'none rest':>10} {'grammar rest':>13} {'same-forward ratio':>19}" if cpu else ""))
    for batch in (1, 64):
        plain, constrained, mask, forward, plain_rest, constrained_rest = [], [], [], [], [], []
        fill_before = engine.masks.fill_s, engine.masks.fill_rows
        for _ in range(args.grammar_rounds):  # alternated: a drift in the host's speed falls on both
            ms, fwd, rest = decode_split_ms(engine, batch, args.prompt_len, n, vocab)
            plain.append(ms), forward.append(fwd), plain_rest.append(rest)
            steps_before, mask_before = engine.num_steps, engine.masks.mask_s
            ms, fwd, rest = decode_split_ms(engine, batch, args.prompt_len, n, vocab, grammar)
            constrained.append(ms), forward.append(fwd), constrained_rest.append(rest)
            mask.append((engine.masks.mask_s - mask_before) * 1000 / max(engine.num_steps - steps_before, 1))
        p, c, m = statistics.median(plain), statistics.median(constrained), statistics.median(mask)
        fill = (engine.masks.fill_s - fill_before[0]) * 1000 / max(engine.masks.fill_rows - fill_before[1], 1)
        result.update({f"none_ms_per_step_b{batch}": round(p, 3), f"grammar_ms_per_step_b{batch}": round(c, 3),
                       f"grammar_b{batch}_step_ratio": round(c / p, 3), f"mask_ms_per_step_b{batch}": round(m, 3),
                       f"fill_ms_per_row_b{batch}": round(fill, 4)})
        line = f"{batch:>5} {p:>13.3f} {c:>16.3f} {c / p:>6.2f} {m:>13.3f} {fill:>12.4f}"
        if cpu:  # the same forward on both sides (the median of all runs'): only the engine's own work differs
            f, pr, cr = statistics.median(forward), statistics.median(plain_rest), statistics.median(constrained_rest)
            ratio = (f + cr) / (f + pr)
            result.update({f"forward_ms_b{batch}": round(f, 3), f"none_rest_ms_b{batch}": round(pr, 3),
                           f"grammar_rest_ms_b{batch}": round(cr, 3),
                           f"grammar_b{batch}_same_forward_ratio": round(ratio, 3)})
            line += f" {f:>11.3f} {pr:>10.3f} {cr:>13.3f} {ratio:>19.3f}"
        print(line)
    print(f"mask fill: {engine.masks.threads} threads (engine.grammar_threads)")
    engine.shutdown()
    return result


# -- --lora ---------------------------------------------------------------------------------------
def lora_adapters(model_dir: Path, count: int, rank: int) -> list[LoraRequest]:
    """`count` adapters of `model_dir`'s LM (every projection of every layer, rank `rank`) in a
    temporary directory removed at exit: the first written by `peft` (`build_tiny_adapter`), the
    others its copies with other random weights (the same shapes; one model load, not `count`)."""
    from safetensors.torch import load_file, save_file

    from mmserve.tiny.lora import build_tiny_adapter

    root = removed_at_exit(Path(tempfile.mkdtemp(prefix="mmserve-bench-lora-")))
    first = build_tiny_adapter(model_dir, root / "a0", seed=0, rank=rank)
    adapters = [LoraRequest("a0", str(first))]
    for i in range(1, count):
        out = root / f"a{i}"
        shutil.copytree(first, out)
        weights = out / "adapter_model.safetensors"
        generator = torch.Generator().manual_seed(i)
        tensors = load_file(weights)
        redrawn = {k: (torch.randn(v.shape, generator=generator) * 0.05).to(v.dtype) for k, v in sorted(tensors.items())}
        save_file(redrawn, weights)
        adapters.append(LoraRequest(f"a{i}", str(out)))
    return adapters


def bench_lora(args) -> None:
    model_dir = random_checkpoint(args)
    start = time.perf_counter()
    adapters = lora_adapters(model_dir, args.lora_adapters, args.lora_rank)
    build_s = time.perf_counter() - start
    lm = language_model(model_dir, args.device)
    batch, n = args.lora_batch, args.decode_tokens
    config = EngineConfig(max_num_seqs=max(batch, 8), max_num_batched_tokens=max(4096, batch * args.prompt_len),
                          max_loras=len(adapters))
    engine = LLMEngine(lm, config)
    engine.load_loras(adapters)
    engine.start()
    vocab = lm.vocab_size
    run_engine(engine, prompts(len(adapters), args.prompt_len, vocab), 4, loras=adapters)  # warm up (adapters held)
    bench_engine(engine, prompts(2, args.prompt_len, vocab), 4)
    base, mixed = [], []
    for _ in range(args.lora_rounds):  # alternated: a drift in the host's speed falls on both
        base.append(decode_ms_per_step(engine, batch, args.prompt_len, n, vocab))
        mixed.append(decode_ms_per_step(engine, batch, args.prompt_len, n, vocab, loras=adapters))
    engine.shutdown()
    b, m = statistics.median(base), statistics.median(mixed)
    result = {"device": args.device, "model": model_dir.name, "lora_adapters": len(adapters),
              "lora_rank": args.lora_rank, "lora_batch": batch, "prompt_len": args.prompt_len, "decode_tokens": n,
              "rounds": args.lora_rounds, "lora_step_ms": round(m, 3), "base_step_ms": round(b, 3),
              "lora_step_ratio": round(m / b, 3), "adapters_build_s": round(build_s, 2)}
    print(f"--lora: batch {batch}, {len(adapters)} adapters of rank {args.lora_rank} (every LM projection), "
          f"{batch // len(adapters)}+ rows each; {args.lora_rounds} rounds a side, alternated (medians)")
    print(f"{'side':>6} {'ms/step':>9} {'rounds':>24}")
    for side, ms, runs in (("base", b, base), ("lora", m, mixed)):
        print(f"{side:>6} {ms:>9.3f} {' '.join(f'{r:.2f}' for r in runs):>24}")
    print(f"lora / base: {m / b:.3f}")
    print(json.dumps(result))


# -- --quantization ------------------------------------------------------------------------------
def bench_quantized(args) -> None:
    from llm_service.model import quantized_gemm
    from mmserve.tiny.quantized import quantize_checkpoint

    dense = random_checkpoint(args)
    quantized = removed_at_exit(Path(tempfile.mkdtemp(prefix="mmserve-bench-quantized-")))
    shutil.copytree(dense, quantized, dirs_exist_ok=True)
    text = json.loads((dense / "config.json").read_text()).get("text_config") or {}
    kv_rows = text.get("num_key_value_heads", 1) * (text.get("head_dim") or
                                                     text.get("hidden_size", 128) // text.get("num_attention_heads", 1))
    block = [math.gcd(128, kv_rows), 128]  # 128 x 128 (the small CPU LM's 64-row k / v: 64 x 128)
    start = time.perf_counter()
    quantize_checkpoint(quantized, args.quantization, block=block, group=128)
    bandwidth = peaks(torch.cuda.get_device_name()).memory_gbs if args.device == "cuda" else None
    n, dtype = args.decode_tokens, dtype_for(args.device)
    probe = torch.zeros(1, 1, dtype=dtype, device=args.device)
    kernels = quantized_gemm.kernel_runs(probe, fp8=args.quantization.startswith("fp8"))
    result: dict = {"device": args.device, "quantization": args.quantization, "model": dense.name, "block": block,
                    "dtype": str(dtype).removeprefix("torch."), "prompt_len": args.prompt_len, "decode_tokens": n,
                    "quantize_s": round(time.perf_counter() - start, 1),
                    "gemm": "kernels" if kernels else "dequantize", "gpu": torch.cuda.get_device_name()
                    if args.device == "cuda" else None, "peak_gbs": bandwidth}
    print(f"{'side':>10} {'weight GB':>10} {'b1 ms':>8} {'b1 bound':>9} {'b64 ms':>8} {'b64 bound':>10}")
    for side, model_dir in (("dense", dense), ("quantized", quantized)):
        lm = language_model(model_dir, args.device)
        engine = LLMEngine(lm, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096))
        engine.start()
        vocab, runner = lm.vocab_size, engine.runner
        bench_engine(engine, prompts(2, args.prompt_len, vocab), 4)  # warm up (CUDA graphs, Triton's compiles)
        weights = sum(p.numel() * p.element_size() for p in lm.modules.parameters())
        kv = bytes_per_block(runner.num_layers, runner.num_kv_heads, runner.head_dim, 1, lm.dtype)
        result[f"{side}_weight_bytes"], result["kv_bytes_per_token"] = weights, kv
        row = f"{side:>10} {weights / 1e9:>10.3f}"
        for batch in (1, 64):
            ms = decode_ms_per_step(engine, batch, args.prompt_len, n, vocab)
            read = weights + batch * (args.prompt_len + n / 2) * kv
            bound = read / (bandwidth * 1e9) * 1e3 if bandwidth else None
            result.update({f"{side}_b{batch}_ms": round(ms, 3),
                           f"{side}_b{batch}_bound_ms": round(bound, 4) if bound else None,
                           f"{side}_b{batch}_ratio_to_bound": round(ms / bound, 3) if bound else None})
            row += f" {ms:>8.3f} {bound or float('nan'):>{9 if batch == 1 else 10}.3f}"
        print(row)
        engine.shutdown()
        del engine, lm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    result.update({f"quantized_b{b}_step_ratio": round(result[f"quantized_b{b}_ms"] / result[f"dense_b{b}_ms"], 3)
                   for b in (1, 64)})
    print(f"{args.quantization} ({result['gemm']}) / dense: batch 1 {result['quantized_b1_step_ratio']}, "
          f"batch 64 {result['quantized_b64_step_ratio']}")
    print(json.dumps(result))


# -- --breakdown ----------------------------------------------------------------------------------
BREAKDOWN_COLUMNS = ("schedule", "prepare", "launch", "sample", "readback", "postprocess")


def _submit(engine: LLMEngine, tag: str, prompts, max_tokens: int) -> None:
    for i, ids in enumerate(prompts):
        engine.add_request(LLMRequest(f"{tag}-{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                           lambda event: None)


def breakdown_case(engine: LLMEngine, batch: int, context: int, steps: int, mixed: bool,
                   profile_steps: int = 3) -> dict:
    """Mean `StepTimes` columns (microseconds) over `steps` steady steps of `batch` decoding
    sequences (`mixed`: each step also prefills a new `context`-token prompt, one token asked),
    and ops per step."""
    vocab = engine.model.vocab_size
    _submit(engine, f"d{batch}{mixed}", prompts(batch, context, vocab, seed=batch), steps + profile_steps + 64)
    while not (len(running := engine.scheduler.running) == batch
               and all(s.num_computed >= s.num_prompt_tokens for s in running)):
        engine.step()
    engine.step()  # the first decode step of the last one admitted
    arrivals = iter(prompts(steps + profile_steps + 2, context, vocab, seed=1000 + batch)) if mixed else None
    engine.step_log = []
    for k in range(steps):
        if arrivals:
            _submit(engine, f"m{batch}-{k}", [next(arrivals)], 1)
        engine.step()
    log, engine.step_log = engine.step_log, None
    log = [t for t in log if t.num_seqs and (t.decode_only != mixed)]
    cuda = engine.model.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU, *([torch.profiler.ProfilerActivity.CUDA] if cuda else [])]
    with torch.profiler.profile(activities=activities) as prof:
        for k in range(profile_steps):
            if arrivals:
                _submit(engine, f"p{batch}-{k}", [next(arrivals)], 1)
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    ops = _count_ops(prof.events(), cuda) / profile_steps
    if cuda and batch == 1 and not mixed:  # where the next change to the decode path starts
        print(f"top kernels of {profile_steps} decode steps at batch 1 (overlap {engine.overlap}):")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))
    for request_id in list(engine._by_id):
        engine.abort(request_id)
    while engine.scheduler.running or engine.scheduler.waiting or engine._launched is not None:
        engine.step()
    row = {c: 1e6 * statistics.fmean(getattr(t, c) for t in log) for c in BREAKDOWN_COLUMNS}
    row["host"] = row["schedule"] + row["prepare"] + row["sample"] + row["postprocess"]
    row["step"] = sum(row[c] for c in BREAKDOWN_COLUMNS)
    devices = [t.device for t in log if t.device is not None]
    row["device"] = 1e6 * statistics.fmean(devices) if devices else None
    row.update(ops=ops, steps=len(log))
    return row


def _count_ops(events, cuda: bool) -> int:
    if cuda:  # kernels the device ran (replayed graphs' included)
        return sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(1 for e in events if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def breakdown_rows(lm, context: int, steps: int, batches=(1, 8, 64), **config) -> dict:
    """Every breakdown row, overlap off and on (`config`: more `EngineConfig` settings); returns
    {"<case> <off|on>": row}."""
    rows = {}
    for overlap in (False, True):
        engine = LLMEngine(lm, EngineConfig(max_num_seqs=max(batches) + 1, max_num_batched_tokens=4096,
                                            async_scheduling=overlap, **config))
        for batch, mixed in [(b, False) for b in batches] + [(8, True)]:
            case = f"{'mixed' if mixed else 'decode'} b{batch} {'on' if overlap else 'off'}"
            rows[case] = breakdown_case(engine, batch, context, steps, mixed)
        engine.shutdown()
    return rows


def print_breakdown(rows: dict) -> None:
    cols = (*BREAKDOWN_COLUMNS, "host", "step", "device", "ops")
    print("per step, microseconds (ops: kernels on CUDA, top-level aten ops on CPU)")
    print(f"{'case':<16}" + "".join(f"{c:>12}" for c in cols))
    for case, row in rows.items():
        print(f"{case:<16}" + "".join(f"{row[c]:>12.1f}" if row[c] is not None else f"{'-':>12}" for c in cols))


def breakdown_summary(rows: dict) -> dict:
    return {f"{case.replace(' ', '_')}_{name}{'' if name == 'ops' else '_us'}": round(row[name], 1)
            for case, row in rows.items() for name in ("host", "step", "device", "ops") if row[name] is not None}


def bench_breakdown(args) -> None:
    model_dir = random_checkpoint(args)
    rows = breakdown_rows(language_model(model_dir, args.device), args.prompt_len, args.steps,
                          split_kv_decode=not args.no_split_kv, fused_ops=not args.no_fused_ops)
    print_breakdown(rows)
    result = {"device": args.device, "model": model_dir.name, "prompt_len": args.prompt_len, "steps": args.steps,
              "fused_ops": not args.no_fused_ops, "split_kv_decode": not args.no_split_kv,
              **breakdown_summary(rows)}
    print(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", help="checkpoint dir (default: random weights, small on CPU, 2b on CUDA)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens per steady-decode measurement")
    ap.add_argument("--grammar-rounds", type=int, default=3,
                    help="--grammar: runs of each side per batch, alternated (the medians' ratio)")
    ap.add_argument("--long-context", type=int, default=None,
                    help="prompt tokens of the long-context decode (default: 8192 on CUDA, 0 = skip, on CPU)")
    ap.add_argument("--long-batch", type=int, default=4)
    ap.add_argument("--no-split-kv", action="store_true",
                    help="decode without split-K attention (flash-decoding), to compare: run once with, once without")
    ap.add_argument("--no-fused-ops", action="store_true",
                    help="CUDA: the decoder's RMSNorms and MLPs unfused (kernels per step before fusion)")
    ap.add_argument("--hybrid-prefix", action="store_true",
                    help="hybrid LM: TTFT of a request sharing a system prompt + image, state snapshots on vs off")
    ap.add_argument("--quick", action="store_true", help="--hybrid-prefix with a 256 + 64 + 16-token prompt")
    ap.add_argument("--repeats", type=int, default=3, help="--hybrid-prefix: request pairs per setting (median)")
    ap.add_argument("--breakdown", action="store_true",
                    help="per-step time by phase (decode at batch 1, 8, 64 and a mixed step), overlap off and on")
    ap.add_argument("--steps", type=int, default=32, help="--breakdown: steps measured per case")
    ap.add_argument("--grammar", action="store_true",
                    help="step time with a 30-property JSON-schema grammar on every row vs none, batch 1 and 64")
    ap.add_argument("--grammar-lm", nargs="+", choices=["small", "2b"], default=None,
                    help="--grammar: the LM shapes, random weights, Qwen's vocabulary (default: 2b and small on "
                         "CUDA, small on CPU)")
    ap.add_argument("--grammar-threads", type=int, default=None,
                    help="--grammar: engine.grammar_threads (default: torch's threads)")
    ap.add_argument("--overlap", choices=["on", "off"], default=None,
                    help="--grammar: steps overlapped (`async_scheduling`) or not (default: on CUDA only)")
    ap.add_argument("--lora", action="store_true",
                    help="decode step, LoRA adapters mixed in the batch vs the base model alone, one engine")
    ap.add_argument("--lora-adapters", type=int, default=4, help="--lora: adapters, the rows spread over them")
    ap.add_argument("--lora-rank", type=int, default=16, help="--lora: each adapter's rank")
    ap.add_argument("--lora-batch", type=int, default=32, help="--lora: sequences decoding together")
    ap.add_argument("--lora-rounds", type=int, default=3,
                    help="--lora: runs of each side, alternated (the medians' ratio)")
    ap.add_argument("--quantization", choices=["fp8-block", "fp8-channel", "awq"], default=None,
                    help="decode b1 / b64 of the random LM quantized in this format beside the same LM dense")
    ap.add_argument("--moe", action="store_true", help="one MoE layer, engine experts path vs transformers' loop: "
                    "bench/moe.py with the other arguments (--device, --dtype, --quick, --repeats, --inputs)")
    ap.add_argument("--tensor-parallel-size", type=int, default=None,
                    help="decode at TP N vs TP 1: bench/llm_tp.py with every argument (--quick, --steps, --device, ...)")
    argv = sys.argv[1:]
    # --moe, --tensor-parallel-size: their own scripts and options (one bench imports no other)
    if "--moe" in argv or any(a.startswith("--tensor-parallel-size") for a in argv):
        script = "moe.py" if "--moe" in argv else "llm_tp.py"
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve().parent / script),
                                  *(a for a in argv if a != "--moe")])
    args = ap.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    modes = {"grammar": bench_grammar, "hybrid_prefix": bench_hybrid_prefix, "breakdown": bench_breakdown,
             "lora": bench_lora, "quantization": bench_quantized}
    if run := next((f for mode, f in modes.items() if getattr(args, mode)), None):
        return run(args)
    from transformers import AutoModelForImageTextToText

    model_dir = random_checkpoint(args)
    ref = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype_for(args.device)).to(args.device).eval()
    lm = language_model(model_dir, args.device)
    engine = LLMEngine(lm, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096,
                                        split_kv_decode=not args.no_split_kv, fused_ops=not args.no_fused_ops))
    engine.start()
    vocab = lm.vocab_size
    result: dict[str, float | str] = {"device": args.device, "model": model_dir.name}
    bench_engine(engine, prompts(2, args.prompt_len, vocab), 4)  # warm up (CUDA graphs, allocator)
    print(f"{'conc':>5} {'generate tok/s':>15} {'engine tok/s':>13} {'speedup':>8} {'gen ITL ms':>11} {'eng ITL ms':>11}")
    for c in args.concurrency:
        reqs = prompts(c, args.prompt_len, vocab)
        g_tps, g_itl = bench_generate(ref, reqs, args.max_tokens, args.device)
        e_tps, e_itl = bench_engine(engine, reqs, args.max_tokens)
        result.update({f"generate_tok_s_c{c}": round(g_tps, 2), f"engine_tok_s_c{c}": round(e_tps, 2),
                       f"speedup_c{c}": round(e_tps / g_tps, 2), f"generate_itl_ms_c{c}": round(g_itl, 2),
                       f"engine_itl_ms_c{c}": round(e_itl, 2)})
        print(f"{c:>5} {g_tps:>15.1f} {e_tps:>13.1f} {e_tps / g_tps:>8.2f} {g_itl:>11.2f} {e_itl:>11.2f}")
    runner, n = engine.runner, args.decode_tokens
    long_context = args.long_context if args.long_context is not None else (8192 if args.device == "cuda" else 0)
    result.update({
        "weight_bytes": sum(p.numel() * p.element_size() for p in lm.modules.parameters()),
        "kv_bytes_per_token": bytes_per_block(runner.num_layers, runner.num_kv_heads, runner.head_dim, 1, lm.dtype),
        "decode_ms_per_token_b1": round(decode_ms_per_step(engine, 1, args.prompt_len, n, vocab), 3),
        "decode_ms_per_step_b64": round(decode_ms_per_step(engine, 64, args.prompt_len, n, vocab), 3),
        "engine_tok_s_b64": round(bench_engine(engine, prompts(64, args.prompt_len, vocab), n)[0], 1),
        "prompt_len": args.prompt_len, "decode_tokens": n,
        "long_context": long_context or None, "long_batch": args.long_batch if long_context else None,
        "decode_ms_per_step_long": round(decode_ms_per_step(engine, args.long_batch, long_context, n, vocab), 3)
        if long_context else None,
        "attention_backend": runner.backend, "cuda_graphs": runner.graphs is not None,
        "split_kv_decode": not args.no_split_kv, "fused_ops": bool(runner.fused_ops),
    })
    long = f"; batch {args.long_batch} over {long_context} tokens {result['decode_ms_per_step_long']} ms/step"
    print(f"steady decode: batch 1 {result['decode_ms_per_token_b1']} ms/token, batch 64 "
          f"{result['decode_ms_per_step_b64']} ms/step ({result['engine_tok_s_b64']:.0f} tok/s with prefills)"
          f"{long if long_context else ''}")
    if args.device == "cuda":
        name = torch.cuda.get_device_name()
        bw = peaks(name).memory_gbs
        result.update({"gpu": name, "bandwidth_bound_ms_b1": round(result["weight_bytes"] / (bw * 1e9) * 1000, 3)
                       if bw else None})
        print(f"batch-1 decode {result['decode_ms_per_token_b1']:.3f} ms/token vs bound "
              f"{result['bandwidth_bound_ms_b1']} ms")
    engine.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
