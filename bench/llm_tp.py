"""Tensor-parallel decode: ms per step and the collectives' share of it at TP N against TP 1.

    python bench/llm.py --tensor-parallel-size 2             # CPU, bench/llm.py's small random LM (runs this script)
    python bench/llm.py --tensor-parallel-size 2 --quick     # 4 steps per case, 8-token prompts: seconds
    python bench/llm.py --tensor-parallel-size 2 --device cuda [--model DIR]   # >= 2 GPUs, one rank per GPU

Same checkpoint, side by side in one run: a TP 1 engine, then a TP N one (rank 0 in this process,
ranks 1..N-1 spawned processes running `llm_service.model.model_runner.rank_main`; gloo on loopback on
the CPU, NCCL on CUDA, rank r on cuda:r). The engines are stepped from this thread (no engine thread):
`batch` sequences are admitted and prefilled, then `--steps` steady decode steps are timed (ms per
step). The collectives' share: rank 0's host seconds inside `TPGroup.all_reduce` and
`TPGroup.broadcast` and the logits' `TPGroup.gather_vocab` (`TPGroup.seconds`; waiting for the slowest rank included) over the step time;
on CUDA an all-reduce's seconds are its launch only (NCCL runs on), so the share is printed for the
CPU. Message bytes: the pickled step message rank 0 broadcasts (`tensor_parallel.message_bytes`).

On the CPU every rank gets `--threads` threads (default: the cores over N) and TP 1 the same, as one
device per rank: TP N uses N times TP 1's cores. Default checkpoint: bench/llm.py's CPU LM (Qwen2-VL
layout, hidden 256, 4 layers, 8 heads / 2 KV heads, intermediate 768, vocab 4096, random float32);
on CUDA Qwen2-VL-2B's architecture (`mmserve.loadgen.checkpoints.qwen2_vl_2b`, random bf16). The
last line printed is one JSON object; bench/gpu_report.py's `tp` part sets it against the N-device
memory-bandwidth bound.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from deployments.cli.ingress_modes import free_loopback_port
from llm_service.config import EngineConfig
from llm_service.engine.llm_engine import LLMEngine, LLMRequest
from llm_service.model.kv_cache import bytes_per_block
from llm_service.model.language_model import LanguageModel
from llm_service.model.model_runner import rank_main
from llm_service.model.tensor_parallel import TPGroup, message_bytes
from llm_service.sampling import SamplingParams
from mmserve.loadgen.checkpoints import qwen2_vl_2b, random_lm

BLOCK = 16


def _rank(rank, size, init, model_dir, dtype, device, config, threads):
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    rank_main(rank, size, init, model_dir, dtype, device, config)


def decode_case(engine: LLMEngine, group: TPGroup | None, batch: int, context: int, steps: int) -> dict:
    """`steps` steady decode steps of `batch` sequences: ms per step, rank 0's collective ms per
    step, and the broadcast message bytes of one such step."""
    g = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = tuple(torch.randint(10, engine.model.vocab_size, (context,), generator=g).tolist())
        engine.add_request(LLMRequest(f"tp-b{batch}-{i}", ids, SamplingParams(max_tokens=steps + 8, ignore_eos=True)),
                           lambda event: None)
    while not (len(engine.scheduler.running) == batch
               and all(s.num_computed >= s.num_prompt_tokens for s in engine.scheduler.running)):
        engine.step()
    engine.step()
    sync = torch.cuda.synchronize if engine.model.device.type == "cuda" else (lambda: None)
    seconds = dict(group.seconds) if group else {}
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_s = (time.perf_counter() - start) / steps
    row = {"ms": 1e3 * step_s, "all_reduce_ms": 0.0, "broadcast_ms": 0.0, "gather_ms": 0.0, "message_bytes": 0}
    if group is not None:
        for kind in ("all_reduce", "broadcast", "gather"):
            row[f"{kind}_ms"] = 1e3 * (group.seconds[kind] - seconds.get(kind, 0.0)) / steps
        sizes, send = [], group.broadcast
        group.broadcast = lambda message=None: (sizes.append(message_bytes(message)), send(message))[1]
        engine.step()  # one more, its message weighed (untimed)
        del group.broadcast
        row["message_bytes"] = max(sizes)
    row["collective_share"] = (row["all_reduce_ms"] + row["broadcast_ms"] + row["gather_ms"]) / row["ms"]
    for request_id in list(engine._by_id):
        engine.abort(request_id)
    while engine.scheduler.running or engine.scheduler.waiting:
        engine.step()
    return row


def run_size(size: int, args, model_dir: Path, batches: list[int]) -> tuple[dict, dict]:
    """Every case at TP `size`: ({batch: row}, facts of the model as rank 0 holds it)."""
    longest = args.prompt_len + args.steps + 16
    config = EngineConfig(tensor_parallel_size=size, max_num_seqs=max(batches) + 1, max_num_batched_tokens=4096,
                          block_size=BLOCK, num_kv_blocks=(max(batches) + 1) * -(-longest // BLOCK) + 8)
    group, procs = None, []
    if size > 1:
        init = f"tcp://127.0.0.1:{free_loopback_port()}"
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(r, size, init, str(model_dir), args.dtype, args.device, config,
                                                 args.threads), daemon=True) for r in range(1, size)]
        for p in procs:
            p.start()
        group = TPGroup(0, size, init, torch.device(args.device), timeout_s=300)
    engine = None
    try:
        lm = LanguageModel(model_dir, dtype=args.dtype, device=args.device, tp=group)
        engine = LLMEngine(lm, config)
        runner = engine.runner
        facts = {"weight_bytes": sum(p.numel() * p.element_size() for p in lm.modules.parameters()),
                 "kv_bytes_per_token": bytes_per_block(runner.num_layers, runner.num_kv_heads, runner.head_dim, 1,
                                                       lm.dtype)}
        decode_case(engine, group, 1, args.prompt_len, 2)  # warm up
        rows = {b: decode_case(engine, group, b, args.prompt_len, args.steps) for b in batches}
        if group is not None:
            facts["all_reduces_per_step"] = group.counts["all_reduce"] // group.counts["broadcast"]
        return rows, facts
    finally:
        if engine is not None:
            engine.shutdown()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        if group is not None:
            group.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensor-parallel-size", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--model", help="checkpoint dir (default: random weights, small on CPU, Qwen2-VL-2B's on CUDA)")
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="steady decode steps timed per case")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / N)")
    ap.add_argument("--quick", action="store_true", help="4 steps per case over 8-token prompts")
    args = ap.parse_args(argv)
    n = args.tensor_parallel_size
    if n < 2:
        raise SystemExit("--tensor-parallel-size must be at least 2 (TP 1 runs beside it)")
    if args.quick:
        args.steps, args.prompt_len = 4, 8
    if args.device == "cuda" and torch.cuda.device_count() < n:
        raise SystemExit(f"TP {n} needs {n} GPUs, found {torch.cuda.device_count()}")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // n)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    if args.model:
        model_dir = Path(args.model)
    elif args.device == "cpu":
        model_dir = random_lm("small", getattr(torch, args.dtype))
    else:
        model_dir = Path(qwen2_vl_2b(tempfile.mkdtemp(prefix="mmserve-bench-tp-2b-")))
    try:
        base, facts1 = run_size(1, args, model_dir, args.batches)
        split, facts_n = run_size(n, args, model_dir, args.batches)
    finally:
        if not args.model:
            shutil.rmtree(model_dir, ignore_errors=True)
    result = {"device": args.device, "model": "small" if not args.model and args.device == "cpu" else str(model_dir),
              "dtype": args.dtype, "tensor_parallel_size": n, "threads_per_rank": args.threads,
              "prompt_len": args.prompt_len, "steps": args.steps, "weight_bytes": facts1["weight_bytes"],
              "rank0_weight_bytes": facts_n["weight_bytes"], "kv_bytes_per_token": facts1["kv_bytes_per_token"],
              "rank0_kv_bytes_per_token": facts_n["kv_bytes_per_token"],
              "all_reduces_per_step": facts_n.get("all_reduces_per_step")}
    print(f"decode ms/step, TP 1 vs TP {n} ({args.device}, {args.dtype}, {args.threads} thread(s) per rank, "
          f"{args.steps} steps over {args.prompt_len}-token prompts)")
    print(f"{'batch':>5} {'TP1 ms':>9} {f'TP{n} ms':>9} {'speedup':>8} {'all-reduce ms':>14} {'broadcast ms':>13} "
          f"{'gather ms':>10} {'coll. share':>11} {'msg bytes':>10}")
    for b in args.batches:
        one, many = base[b], split[b]
        speedup = one["ms"] / many["ms"]
        print(f"{b:>5} {one['ms']:>9.3f} {many['ms']:>9.3f} {speedup:>7.2f}x {many['all_reduce_ms']:>14.3f} "
              f"{many['broadcast_ms']:>13.3f} {many['gather_ms']:>10.3f} {many['collective_share']:>10.1%} {many['message_bytes']:>10}")
        result.update({f"tp1_ms_per_step_b{b}": round(one["ms"], 3), f"tp{n}_ms_per_step_b{b}": round(many["ms"], 3),
                       f"tp{n}_speedup_b{b}": round(speedup, 3),
                       **{f"tp{n}_{k}_b{b}": round(many[k], 3)
                          for k in ("all_reduce_ms", "broadcast_ms", "gather_ms")},
                       f"tp{n}_collective_share_b{b}": round(many["collective_share"], 4),
                       f"tp{n}_message_bytes_b{b}": many["message_bytes"]})
    print(f"{result['all_reduces_per_step']} all-reduces, 1 broadcast and 1 logits gather per step on each rank; rank 0 holds "
          f"{facts_n['weight_bytes'] / facts1['weight_bytes']:.0%} of the weights")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
