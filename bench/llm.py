"""LLM engine vs `transformers` generate: output tokens/s and inter-token latency at concurrency 1, 8, 32.

    python bench/llm.py                      # CPU, a small random Qwen2-VL LM, a few minutes
    python bench/llm.py --device cuda        # full-size Qwen2-VL-2B LM config (random weights)

(a) `generate` serves the requests one at a time (what a replica without batching does);
(b) the engine gets all of them at once. The last line printed is one JSON object.
Then steady decode (every sequence past its prefill): ms per step at batch 1 and 64, and (CUDA) at
batch 4 over 8k-token contexts, with what bounds them (weight bytes, KV bytes per token); with
--device cuda also batch-1 against the weight-bandwidth bound (weight bytes / HBM bandwidth).
bench/gpu_report.py turns these into ratios to the physical limits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.checkpoints import QWEN2_VL_2B_TEXT  # noqa: E402
from bench.device_peaks import peaks  # noqa: E402
from llm_service.config import EngineConfig  # noqa: E402
from llm_service.engine import LLMEngine, LLMRequest  # noqa: E402
from llm_service.kv_cache import bytes_per_block  # noqa: E402
from llm_service.model import LanguageModel  # noqa: E402
from llm_service.sampling import SamplingParams  # noqa: E402

SIZES = {
    # CPU default: small enough for a few minutes on 2 cores, big enough that compute shows
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096),
    "2b": QWEN2_VL_2B_TEXT,  # Qwen2-VL-2B-Instruct's language model
}


def random_checkpoint(size: str, dtype: torch.dtype, device: str) -> Path:
    """A Qwen2-VL checkpoint with random weights (tiny vision tower, LM of `size`)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(SIZES[size], rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                              "mrope_section": [16, 24, 24] if size == "2b" else [4, 6, 6]},
                tie_word_embeddings=size == "2b", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=1, embed_dim=32, hidden_size=text["hidden_size"], num_heads=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=3, video_token_id=4,
                           vision_start_token_id=5, vision_end_token_id=6)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2VLForConditionalGeneration(config).to(dtype)
    out = Path(tempfile.mkdtemp(prefix=f"mmserve-bench-{size}-"))
    model.save_pretrained(out)
    return out


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, vocab, (length,), generator=g).tolist() for _ in range(n)]


def bench_generate(model, reqs, max_tokens, device) -> tuple[float, float]:
    """(tokens/s, mean inter-token ms) serving `reqs` one at a time with `generate`."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    gaps, total, start = [], 0, time.perf_counter()
    for ids in reqs:
        clock = Clock()
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, streamer=clock)
        total += out.shape[1] - x.shape[1]
        t = clock.times[1:]  # first put() is the prompt
        gaps += [b - a for a, b in zip(t, t[1:])]
    return total / (time.perf_counter() - start), 1000 * sum(gaps) / max(len(gaps), 1)


def run_engine(engine: LLMEngine, reqs, max_tokens) -> tuple[float, list[list[float]]]:
    """All of `reqs` submitted at once: (seconds until the last finished, each one's token times)."""
    times: dict[int, list[float]] = {i: [] for i in range(len(reqs))}
    done = threading.Event()
    left = [len(reqs)]
    lock = threading.Lock()

    def emit(i):
        def on_event(ev):
            times[i].append(time.perf_counter())
            if ev.finish_reason:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return on_event

    start = time.perf_counter()
    for i, ids in enumerate(reqs):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(LLMRequest(f"b{start}-{i}", tuple(ids), params), emit(i))
    done.wait()
    return time.perf_counter() - start, list(times.values())


def bench_engine(engine: LLMEngine, reqs, max_tokens) -> tuple[float, float]:
    """(tokens/s, mean inter-token ms) with all of `reqs` submitted at once."""
    elapsed, times = run_engine(engine, reqs, max_tokens)
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    return sum(len(t) for t in times) / elapsed, 1000 * sum(gaps) / max(len(gaps), 1)


def decode_ms_per_step(engine: LLMEngine, batch: int, context: int, tokens: int, vocab: int) -> float:
    """Steady decode of `batch` sequences over `context`-token prompts: the mean gap between a
    sequence's tokens once every sequence has its first (no prefill chunk falls in a gap)."""
    _, times = run_engine(engine, prompts(batch, context, vocab), tokens)
    steady = max(t[0] for t in times)
    gaps = [b - a for t in times for a, b in zip(t, t[1:]) if a >= steady]
    return 1000 * sum(gaps) / max(len(gaps), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", help="checkpoint dir (default: random weights, small on CPU, 2b on CUDA)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--decode-tokens", type=int, default=128, help="tokens per steady-decode measurement")
    ap.add_argument("--long-context", type=int, default=None,
                    help="prompt tokens of the long-context decode (default: 8192 on CUDA, 0 = skip, on CPU)")
    ap.add_argument("--long-batch", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model_dir = Path(args.model) if args.model else random_checkpoint(
        "small" if args.device == "cpu" else "2b", dtype, args.device)
    from transformers import AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    lm = LanguageModel(model_dir, dtype=str(dtype).removeprefix("torch."), device=args.device)
    engine = LLMEngine(lm, EngineConfig(max_num_seqs=64, max_num_batched_tokens=4096))
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
    if not args.model:
        shutil.rmtree(model_dir, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
