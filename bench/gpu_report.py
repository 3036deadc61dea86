"""Every GPU figure in one command: one record appended to bench/results/gpu.jsonl per run, and
docs/gpu-figures.md regenerated from the whole file.

    python bench/gpu_report.py                          # every part, on the GPU
    python bench/gpu_report.py --only engine serve      # some parts: tests, engine, encoder, serve, tp
    python bench/gpu_report.py --device cpu --only engine   # same shape, CPU sizes: bench/results/cpu.jsonl
    python bench/gpu_report.py --render-only            # docs/gpu-figures.md from gpu.jsonl again
    python bench/gpu_report.py --from-log DIR           # the record of a `scripts/gpu-check all|cli DIR` run

Each part runs what already measures (subprocesses; their last JSON line is read) and adds its
figures to the run's record; every figure is in every record, null when this run did not measure
it. On CUDA every part fits in 8 minutes on an H100:
- tests: tests/gpu/test_gpu_app.py (the app on one GPU) -> gpu_app_tests {passed, failed, skipped}.
- engine: bench/llm.py (Qwen2-VL-2B's LM, random bf16) and its runs in ENGINE_BENCHES (--breakdown,
  --grammar, --moe, --quantization fp8-block, --lora) -> steady decode, each against its bound
  (docs/gpu-figures.md says which).
- encoder: bench/encoder.py (the full-size Qwen2-VL vision tower) -> forward images/s and MFU against
  the dense bf16 peak at 448^2 and 1024^2, the pool end to end over the forward alone, the token
  budget over one image per forward.
- serve: bench/serve.py --compare colocated (random full-size Qwen2-VL-2B,
  mmserve/loadgen/checkpoints.py; each replica on half the GPU) -> goodput and p99 TTFT of both
  modes; bench/transfer.py -> GB/s of a 20 MB embedding by each transport, against the memory
  bandwidth.
- tp: bench/llm_tp.py (bench/llm.py --tensor-parallel-size 2) on >= 2 GPUs -> decode ms per step at
  batch 1 and 64 at TP 2 against TP 1 on the same checkpoint, each against its bound (rank 0's
  weights + its half of the KV at one device's peak bandwidth: the 2-device bound), in the record's
  `tp` (not a figure column: {"skipped": "needs >= 2 GPUs, found N"} on fewer GPUs).
- cli (from a `scripts/gpu-check cli DIR` log only): bench/cli.py -> readme_ready_s,
  readme_first_answer_ms, readme_passed; a failed check is named in `failed_parts`.
Peaks come from mmserve/loadgen/device_peaks.py by the CUDA device name (--peak-gbs / --peak-tflops
override). CPU records are for the shape (CI) and are not comparable with GPU ones.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from contextlib import suppress
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

from mmserve.loadgen.device_peaks import Peaks, peaks

ROOT = Path(__file__).resolve().parents[1]

PARTS = ("tests", "engine", "encoder", "serve", "tp")
TP_SIZE = 2
PART_TIMEOUT_S = 900  # each part is sized for under 8 minutes on an H100


class Figure(NamedTuple):
    name: str
    unit: str
    part: str


FIGURES = (
    Figure("gpu_app_tests", "tests passed / failed / skipped", "tests"),
    Figure("decode_b1_ms", "ms/token", "engine"),
    Figure("decode_b1_bound_ms", "ms/token", "engine"),
    Figure("decode_b1_ratio_to_bound", "x the bound", "engine"),
    Figure("decode_b64_ms", "ms/step", "engine"),
    Figure("decode_b64_bound_ms", "ms/step", "engine"),
    Figure("decode_b64_frac_of_bound", "fraction of the bound's speed", "engine"),
    Figure("decode_b64_tok_s", "tok/s, prefills included", "engine"),
    Figure("decode_8k_b4_ms", "ms/step", "engine"),
    Figure("decode_8k_b4_bound_ms", "ms/step", "engine"),
    Figure("decode_8k_b4_ratio_to_bound", "x the bound", "engine"),
    *(Figure(f"decode_b{b}_host_us", "us per step outside the forward (default overlap mode)", "engine")
      for b in (1, 64)),
    Figure("decode_b1_ops_per_step", "kernels per step (CUDA; top-level aten ops on CPU)", "engine"),
    Figure("grammar_b1_step_ratio", "decode step with a 30-property JSON-schema grammar / without, batch 1", "engine"),
    Figure("grammar_b64_step_ratio", "the same at batch 64 (target <= 1.10)", "engine"),
    Figure("fp8_decode_b1_ms", "ms/token, the LM's projections in block FP8 (bench/llm.py --quantization fp8-block)",
           "engine"),
    Figure("fp8_decode_b1_ratio_to_bound", "x the bound: the FP8 weights as held + KV at peak memory bandwidth",
           "engine"),
    Figure("fp8_decode_b64_ms", "ms/step, the same at batch 64", "engine"),
    Figure("fp8_decode_b64_ratio_to_bound", "x the bound, batch 64", "engine"),
    Figure("fp8_b1_step_vs_bf16", "FP8 step / the bf16 step of the same run, batch 1", "engine"),
    Figure("fp8_b64_step_vs_bf16", "FP8 step / the bf16 step of the same run, batch 64 (target <= 0.7)", "engine"),
    Figure("lora_b32_step_vs_base", "decode step at batch 32 with 4 rank-16 LoRA adapters on every LM projection / "
           "the base model's, the same engine (bench/llm.py --lora; target <= 1.3 on CUDA)", "engine"),
    Figure("moe_b1_ms", "ms per call of one MoE layer (Qwen3-VL-30B-A3B's), the engine's path (moe_engine_path)",
           "engine"),
    Figure("moe_b64_ms", "the same at batch 64", "engine"),
    Figure("moe_b1_vs_bandwidth_bound", "x the bound: the touched experts' weight bytes at peak memory bandwidth",
           "engine"),
    Figure("moe_b64_vs_bandwidth_bound", "the same at batch 64", "engine"),
    Figure("moe_b1_grouped_vs_eager", "transformers' per-expert loop ms / the engine's grouped PyTorch path ms",
           "engine"),
    Figure("moe_b64_grouped_vs_eager", "the same at batch 64 (target >= 2)", "engine"),
    *(Figure(f"vit_forward_{side}_images_per_s", "images/s", "encoder") for side in (448, 1024)),
    *(Figure(f"vit_mfu_{side}", "fraction of the dense bf16 peak", "encoder") for side in (448, 1024)),
    *(Figure(f"vit_ceiling_mfu_{side}", "fraction of the dense bf16 peak, at the measured matmul and attention rates",
             "encoder") for side in (448, 1024)),
    *(Figure(f"vit_frac_of_ceiling_{side}", "forward speed over the ceiling's", "encoder") for side in (448, 1024)),
    *(Figure(f"encoder_pool_{side}_images_per_s", "images/s", "encoder") for side in (448, 1024)),
    Figure("encoder_pool_over_forward_448", "ratio", "encoder"),
    Figure("encoder_budget_vs_single_448", "x one image per forward", "encoder"),
    *(Figure(f"serve_{mode}_{k}", unit, "serve") for k, unit in (("goodput_rps", "req/s"), ("p99_ttft_ms", "ms"))
      for mode in ("disagg", "colocated")),
    *(Figure(f"transfer_{transport}_{k}", unit, "serve") for k, unit in (("gbs", "GB/s"), ("frac_of_bandwidth",
      "fraction of peak memory bandwidth")) for transport in ("object_store", "grpc")),
    Figure("readme_ready_s", "s from `python3 -m deployments.cli.main serve --model DIR --dtype bfloat16` (no "
           "other flag) to ready (bench/cli.py)", "cli"),
    Figure("readme_first_answer_ms", "ms, the README's curl (an image, 16 tokens) right after ready", "cli"),
    Figure("readme_passed", "every step of scripts/gpu-check cli passed (README curl, chat over HTTP and gRPC, "
           "reflection, the dashboard's Serve API, the drain)", "cli"),
)

# CPU: the small sizes the benches' own smallest runs use (tests/unit/test_bench_scripts.py)
CPU_ARGS = {
    "llm": ["--prompt-len", "8", "--max-tokens", "4", "--concurrency", "1", "--decode-tokens", "16",
            "--long-context", "0"],
    "breakdown": ["--steps", "4", "--prompt-len", "8"],
    "grammar": ["--prompt-len", "8", "--decode-tokens", "8", "--grammar-rounds", "1"],
    "moe": ["--quick", "--repeats", "2", "--inputs", "2"],
    "fp8": ["--prompt-len", "8", "--decode-tokens", "8"],
    "lora": ["--prompt-len", "8", "--decode-tokens", "4", "--lora-rounds", "1", "--lora-batch", "8",
             "--lora-adapters", "2", "--lora-rank", "4"],
    "encoder": ["--items", "4"],
    "serve": ["--compare", "colocated", "--quick", "--num-prompts", "8", "--unloaded-requests", "2",
              "--request-rate", "1"],
    "transfer": ["--iters", "1", "--ingress-iters", "2"],
    "tp": ["--quick"],
}
CUDA_ARGS = {
    "llm": ["--long-context", "8192", "--long-batch", "4"],
    "breakdown": ["--steps", "64"],
    "encoder": ["--workers", "8"],
    "serve": ["--compare", "colocated", "--dtype", "bfloat16", "--num-cpus", "8", "--num-prompts", "32",
              "--unloaded-requests", "4", "--input-len", "128", "--output-len", "64"],
    "transfer": ["--iters", "8", "--ingress-iters", "16"],  # host-side figures: a short run fits a device call
}


class PartFailed(Exception):
    """A part that did not finish; `figures`: what it measured before (kept in the record)."""

    def __init__(self, message: str, figures: dict | None = None):
        super().__init__(message)
        self.figures = figures or {}


def ratio(a: float | None, b: float | None, digits: int = 4) -> float | None:
    return round(a / b, digits) if a is not None and b else None


def bound_ms(nbytes: float, peak: Peaks) -> float | None:
    """Reading `nbytes` once at peak memory bandwidth, ms (None: no bandwidth known)."""
    return nbytes / (peak.memory_gbs * 1e9) * 1e3 if peak.memory_gbs else None


# -- running what measures ----------------------------------------------------------------------
def run(cmd: list[str], timeout_s: float) -> tuple[int, str | None]:
    """Runs `cmd` from the checkout (its output echoed to stderr); (exit code, last JSON line)."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))  # its Ray too
    timer.start()
    last = None
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            if line.startswith("{"):
                last = line
        proc.wait()
    finally:
        timer.cancel()
    return proc.returncode, last


def bench_json(script: str, args: list[str], timeout_s: float) -> dict:
    code, last = run([sys.executable, str(ROOT / "bench" / script), *args], timeout_s)
    if code == -signal.SIGKILL:
        raise PartFailed(f"bench/{script} killed after {timeout_s:.0f} s")
    if code != 0 or last is None:
        raise PartFailed(f"bench/{script} exited {code}" + ("" if last else " without its JSON line"))
    return json.loads(last)


def tests_part(ns, peak: Peaks) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        code, _ = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                       f"--junitxml={junit}", "tests/gpu/test_gpu_app.py"], ns.timeout)
        if code not in (0, 1, 5) or not junit.exists():  # 1: some failed (a figure); 5: none collected
            raise PartFailed(f"pytest exited {code}")
        counts = junit_counts([junit], "test_gpu_app") or {"passed": 0, "failed": 0, "skipped": 0}
    return {"gpu_app_tests": counts}


def engine_figures(r: dict, peak: Peaks) -> dict:
    """bench/llm.py's result -> decode figures; a step's bound reads the weights once and every
    sequence's KV (mean context over the measured tokens) at peak memory bandwidth."""
    def bound(batch: int, context: float) -> float | None:
        ms = bound_ms(r["weight_bytes"] + batch * context * r["kv_bytes_per_token"], peak)
        return ms and round(ms, 4)

    mean_context = r["prompt_len"] + r["decode_tokens"] / 2
    b1, b1_bound = r["decode_ms_per_token_b1"], bound(1, mean_context)
    b64, b64_bound = r["decode_ms_per_step_b64"], bound(64, mean_context)
    long = r["decode_ms_per_step_long"] if (r["long_context"], r["long_batch"]) == (8192, 4) else None
    long_bound = bound(4, 8192 + r["decode_tokens"] / 2) if long is not None else None
    return {"decode_b1_ms": b1, "decode_b1_bound_ms": b1_bound, "decode_b1_ratio_to_bound": ratio(b1, b1_bound),
            "decode_b64_ms": b64, "decode_b64_bound_ms": b64_bound, "decode_b64_frac_of_bound": ratio(b64_bound, b64),
            "decode_b64_tok_s": r["engine_tok_s_b64"], "decode_8k_b4_ms": long, "decode_8k_b4_bound_ms": long_bound,
            "decode_8k_b4_ratio_to_bound": ratio(long, long_bound)}


def breakdown_figures(r: dict, peak: Peaks | None = None) -> dict:
    """bench/llm.py --breakdown's result -> host time and ops per decode step, in the mode the
    engine runs by default on that device (steps overlapped on CUDA)."""
    mode = "on" if r["device"] == "cuda" else "off"
    return {"decode_b1_host_us": r[f"decode_b1_{mode}_host_us"], "decode_b64_host_us": r[f"decode_b64_{mode}_host_us"],
            "decode_b1_ops_per_step": r[f"decode_b1_{mode}_ops"]}


def moe_figures(r: dict, peak: Peaks) -> dict:
    """bench/llm.py --moe's result -> the engine's experts path per layer call against its bound, the
    weight bytes of the experts the batch touches read once at peak memory bandwidth. The engine's
    path is the one the run names (runs before 2026-11-26 name none: the Triton kernel on CUDA)."""
    path = r.get("moe_engine_path") or ("triton" if r["device"] == "cuda" else "grouped")
    out = {}
    for b in (1, 64):
        ms = r.get(f"moe_b{b}_{path}_ms")
        bound = bound_ms(r[f"moe_b{b}_bytes_touched"], peak)
        out.update({f"moe_b{b}_ms": ms, f"moe_b{b}_vs_bandwidth_bound": ratio(ms, bound, 3),
                    f"moe_b{b}_grouped_vs_eager": r[f"moe_b{b}_grouped_vs_eager"]})
    return out


def fp8_figures(r: dict, peak: Peaks) -> dict:
    """bench/llm.py --quantization fp8-block's result -> the FP8 LM's decode against its bound (as
    `engine_figures`, its weight bytes as held) and over the bf16 LM's step in the same run."""
    if r.get("quantization") != "fp8-block":
        return {}
    out = {}
    for b in (1, 64):
        ms = r["quantized_b%d_ms" % b]
        kv = b * (r["prompt_len"] + r["decode_tokens"] / 2) * r["kv_bytes_per_token"]
        bound = bound_ms(r["quantized_weight_bytes"] + kv, peak)
        out.update({f"fp8_decode_b{b}_ms": ms, f"fp8_decode_b{b}_ratio_to_bound": ratio(ms, bound),
                    f"fp8_b{b}_step_vs_bf16": r[f"quantized_b{b}_step_ratio"]})
    return out


# bench/llm.py's runs in the engine part (their sizes: CPU_ARGS / CUDA_ARGS): (the flag, the key that tells
# each result apart in a log, its figures)
ENGINE_BENCHES = {"llm": ("", "decode_ms_per_token_b1", engine_figures),
                  "breakdown": ("--breakdown", "decode_b1_on_host_us", breakdown_figures),
                  "grammar": ("--grammar", "grammar_b1_step_ratio",
                              lambda r, peak: {k: r[k] for k in ("grammar_b1_step_ratio", "grammar_b64_step_ratio")}),
                  "moe": ("--moe", "moe_engine_path", moe_figures),
                  "fp8": ("--quantization=fp8-block", "quantized_b64_step_ratio", fp8_figures),
                  "lora": ("--lora", "lora_step_ratio",
                           lambda r, peak: {"lora_b32_step_vs_base": r["lora_step_ratio"]})}


def engine_part(ns, peak: Peaks) -> dict:
    out = {}
    for run, (flag, _, figures) in ENGINE_BENCHES.items():
        args = ["--device", ns.device, *([flag] if flag else []), *ns.sizes.get(run, [])]
        out |= figures(bench_json("llm.py", args, ns.timeout), peak)
    return out


def tp_figures(r: dict, peak: Peaks) -> dict:
    """bench/llm_tp.py's result -> `tp`: ms per decode step at TP 1 and TP N, the speedup, and each
    against its bound: TP 1 reads all weights and KV on one device, TP N's rank 0 (its weights,
    the norms whole, and its vocabulary slice) its shard and its heads' KV, at one device's peak bandwidth."""
    n, context = r["tensor_parallel_size"], r["prompt_len"] + r["steps"] / 2
    out = {"size": n, "device_gbs": peak.memory_gbs}
    for b in (1, 64):
        one, many = r[f"tp1_ms_per_step_b{b}"], r[f"tp{n}_ms_per_step_b{b}"]
        bounds = [bound_ms(w + b * context * kv, peak) for w, kv in (
            (r["weight_bytes"], r["kv_bytes_per_token"]), (r["rank0_weight_bytes"], r["rank0_kv_bytes_per_token"]))]
        out.update({f"b{b}_tp1_ms": one, f"b{b}_tp{n}_ms": many, f"b{b}_speedup": ratio(one, many, 3),
                    f"b{b}_tp1_bound_ms": bounds[0] and round(bounds[0], 4),
                    f"b{b}_tp{n}_bound_ms": bounds[1] and round(bounds[1], 4),
                    f"b{b}_tp{n}_ratio_to_bound": ratio(many, bounds[1], 3),
                    f"b{b}_collective_share": r[f"tp{n}_collective_share_b{b}"],
                    f"b{b}_message_bytes": r[f"tp{n}_message_bytes_b{b}"]})
    return {"tp": out}


def tp_part(ns, peak: Peaks) -> dict:
    if ns.device == "cuda":
        found = len((_out(["nvidia-smi", "-L"]) or "").splitlines())
        if found < TP_SIZE:
            return {"tp": {"skipped": f"needs >= {TP_SIZE} GPUs, found {found}"}}
    args = ["--device", ns.device, "--tensor-parallel-size", str(TP_SIZE), *ns.sizes.get("tp", [])]
    return tp_figures(bench_json("llm_tp.py", args, ns.timeout), peak)


def encoder_figures(r: dict, peak: Peaks) -> dict:
    """bench/encoder.py's CUDA rows -> encoder figures (its CPU table measures other sizes: none)."""
    if "cuda_448_forward_images_per_s" not in r:
        return {}
    out = {"encoder_budget_vs_single_448": round(r["cuda_448_budget_vs_single"], 3),
           "encoder_pool_over_forward_448": ratio(r["cuda_448_images_per_s"], r["cuda_448_forward_images_per_s"], 3)}
    for side in (448, 1024):
        out[f"vit_forward_{side}_images_per_s"] = round(r[f"cuda_{side}_forward_images_per_s"], 2)
        out[f"vit_mfu_{side}"] = ratio(r[f"cuda_{side}_forward_tflops"], peak.bf16_tflops)
        out[f"encoder_pool_{side}_images_per_s"] = round(r[f"cuda_{side}_images_per_s"], 2)
        if f"cuda_{side}_frac_of_ceiling" in r:  # bench/encoder.py from 2026-11-25 on
            out[f"vit_ceiling_mfu_{side}"] = round(r[f"cuda_{side}_ceiling_mfu"], 4)
            out[f"vit_frac_of_ceiling_{side}"] = round(r[f"cuda_{side}_frac_of_ceiling"], 3)
    return out


def encoder_part(ns, peak: Peaks) -> dict:
    tflops = ["--peak-tflops", str(peak.bf16_tflops)] if peak.bf16_tflops else []
    return encoder_figures(bench_json("encoder.py", ["--device", ns.device, *ns.sizes["encoder"], *tflops],
                                      ns.timeout), peak)


def serve_figures(summary: dict) -> dict:
    return {f"serve_{mode}_{k}": summary[f"{mode}_{k}"] for mode in ("disagg", "colocated")
            for k in ("goodput_rps", "p99_ttft_ms")}


def transfer_figures(transfer: dict, peak: Peaks) -> dict:
    out = {}
    for transport in ("object_store", "grpc"):
        gbs = round(transfer[f"{transport}_mb_s_20mb"] / 1000, 3)
        out[f"transfer_{transport}_gbs"] = gbs
        out[f"transfer_{transport}_frac_of_bandwidth"] = ratio(gbs, peak.memory_gbs, 8)
    return out


def serve_part(ns, peak: Peaks) -> dict:
    with tempfile.TemporaryDirectory() as plots:
        args = [*ns.sizes["serve"], "--plot-dir", plots]
        if ns.serve_requests:  # each request's client and server stage times
            args += ["--result-json", str(ns.serve_requests)]
        if ns.device == "cuda":  # the checkpoint built in a child: this process stays a thin parent
            models = Path(os.environ.get("MMSERVE_CACHE", Path.home() / ".cache" / "mmserve"))
            build = ("from mmserve.loadgen.checkpoints import qwen2_vl_2b; "
                     f"print(qwen2_vl_2b({str(models / 'qwen2_vl_2b_random')!r}))")
            built = subprocess.run([sys.executable, "-c", build], cwd=ROOT, capture_output=True, text=True)
            if built.returncode != 0:
                raise PartFailed(f"building the full-size checkpoint: {built.stderr[-500:]}")
            args += ["--device", "cuda", "--model", built.stdout.strip().splitlines()[-1]]
        figures = serve_figures(bench_json("serve.py", args, ns.timeout))
    try:
        return figures | transfer_figures(bench_json("transfer.py", ns.sizes["transfer"], ns.timeout), peak)
    except PartFailed as e:  # the serve figures stand without the transfer ones
        raise PartFailed(str(e), figures) from e


PART_RUNS = {"tests": tests_part, "engine": engine_part, "encoder": encoder_part, "serve": serve_part, "tp": tp_part}


# -- the record ---------------------------------------------------------------------------------
def _version(package: str) -> str | None:
    with suppress(metadata.PackageNotFoundError):
        return metadata.version(package)


def _out(cmd: list[str]) -> str | None:
    with suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout.strip()


def device_name(device: str) -> str:
    """As CUDA names it (asked in a child process: this one holds no CUDA memory while parts run)."""
    if device == "cpu":
        return "cpu"
    if not (name := _out([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"])):
        raise SystemExit("no CUDA device here: use --device cpu")
    return name.splitlines()[-1]


def new_record(device: str, peak: Peaks, host: dict | None = None) -> dict:
    """An empty record of this checkout; `host`: the versions of the machine that ran (--from-log)."""
    driver = _out(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) if device != "cpu" else None
    changes = _out(["git", "status", "--porcelain", "--untracked-files=no"])  # None: not a git checkout
    record = {
        "date": datetime.date.today().isoformat(), "commit": _out(["git", "rev-parse", "HEAD"]),
        "dirty": None if changes is None else bool(changes), "device": device, "driver": driver.splitlines()[0] if driver else None,
        "torch": _version("torch"), "triton": _version("triton") or _version("pytorch-triton"),
        "transformers": _version("transformers"), "peak_gbs": peak.memory_gbs, "peak_tflops": peak.bf16_tflops,
        "parts": [], "failed_parts": {},
    }
    if host is not None:
        record.update({k: host.get(k) for k in ("driver", "torch", "triton", "transformers")})
    # tp: tp_part's figures or {"skipped": why}
    record.update({f.name: None for f in FIGURES}, tp=None, units={f.name: f.unit for f in FIGURES})
    return record


# -- a `scripts/gpu-check all` run, from its logs ------------------------------------------------
HOST_LINE = "# host "


def junit_counts(paths: list[Path], name: str) -> dict | None:
    """{passed, failed, skipped} of the test cases of file `name` in these junit files (None: none ran)."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            if name not in (case.get("file") or case.get("classname", "").replace(".", "/")):
                continue
            kind = "failed" if case.find("failure") is not None or case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "passed"
            counts[kind] += 1
    return counts if sum(counts.values()) else None


def record_from_log(folder: Path, peak_gbs: float | None, peak_tflops: float | None) -> dict:
    """The record of what a `scripts/gpu-check all DIR` run finished: each bench's last JSON line
    in DIR/bench.log, told apart by its keys; the app tests' counts from DIR/junit-*.xml; the host's
    versions from the log's first line. A bench that left no result is named in `failed_parts`."""
    lines = (folder / "bench.log").read_text().splitlines()
    host = next((json.loads(line.removeprefix(HOST_LINE)) for line in lines if line.startswith(HOST_LINE)), None)
    if host is None:
        raise SystemExit(f"{folder / 'bench.log'} has no '{HOST_LINE}' line: not a scripts/gpu-check all log")
    peak = peaks(host["device"], peak_gbs, peak_tflops)
    record = new_record(host["device"], peak, host)
    results = [json.loads(line) for line in lines if line.startswith("{")]
    found, figures = {}, {}
    for flag, key, figures_of in ENGINE_BENCHES.values():
        r = found[f"bench/llm.py {flag}".strip()] = next((r for r in reversed(results) if key in r), None)
        figures |= figures_of(r, peak) if r else {}
    if any(found.values()):
        record["parts"].append("engine")
        # a bench the log shows started and left no result failed; one it never started was not asked for
        modes = {flag for flag, *_ in ENGINE_BENCHES.values() if flag}
        started = [set(line.split()) for line in lines if line.startswith("== python3 bench/llm.py")]
        ran = {bench: any(modes & words == set(bench.split()[1:]) for words in started) for bench in found}
        if failed := [bench for bench, r in found.items() if r is None and ran[bench]]:
            record["failed_parts"]["engine"] = "no result in the log from " + ", ".join(failed)
    if encoder := next((r for r in reversed(results) if "cuda_448_forward_images_per_s" in r), None):
        figures |= encoder_figures(encoder, peak)
        record["parts"].append("encoder")
    _serve_from_log(results, lines, record, figures, peak)
    _cli_from_log(results, lines, record, figures)
    if tests := junit_counts(sorted(folder.glob("junit*.xml")), "test_gpu_app") or app_progress(folder):
        figures["gpu_app_tests"] = tests
        record["parts"].insert(0, "tests")
    record.update(figures)
    return record


def _serve_from_log(results: list[dict], lines: list[str], record: dict, figures: dict, peak: Peaks) -> None:
    """The serve part's figures from the lines bench/serve.py and bench/transfer.py printed (gpu_report
    echoes them), whether the part finished or was cut at its cap; its failure from its own record."""
    serve = next((r for r in reversed(results) if "disagg_goodput_rps" in r), None)
    transfer = next((r for r in reversed(results) if "object_store_mb_s_20mb" in r), None)
    figures |= (serve_figures(serve) if serve else {}) | (transfer_figures(transfer, peak) if transfer else {})
    if serve or transfer:
        record["parts"].append("serve")
    if failed := next((r["failed_parts"]["serve"] for r in reversed(results) if "serve" in r.get("failed_parts", {})),
                      None):
        record["failed_parts"]["serve"] = failed
    elif any(line.startswith("== python3 bench/gpu_report.py --only serve") for line in lines) and not transfer:
        record["failed_parts"]["serve"] = "no result in the log from " + (
            "bench/transfer.py" if serve else "bench/serve.py") + " (cut at the part's cap)"


def _cli_from_log(results: list[dict], lines: list[str], record: dict, figures: dict) -> None:
    """`scripts/gpu-check cli`'s figures from bench/cli.py's line; the checks that failed (or no line
    from a run that started) in `failed_parts["cli"]`."""
    if (cli := next((r for r in reversed(results) if "readme_passed" in r), None)) is None:
        if any(line.startswith("== python3 bench/cli.py") for line in lines):
            record["failed_parts"]["cli"] = "no result in the log from bench/cli.py (cut at its cap)"
        return
    figures |= {k: cli[k] for k in ("readme_ready_s", "readme_first_answer_ms", "readme_passed")}
    record["parts"].append("cli")
    if failed := [f"{name}: {why}" for name, why in cli.get("checks", {}).items() if why is not True]:
        record["failed_parts"]["cli"] = "; ".join(failed)


def app_progress(folder: Path) -> dict | None:
    """{passed, failed, skipped, cut} read off pytest's progress line for tests/gpu/test_gpu_app.py in
    DIR/tests.log, where the run was cut at its cap before its junit file was written."""
    log = folder / "tests.log"
    lines = log.read_text().splitlines() if log.exists() else []
    start = next((i for i, line in enumerate(lines) if line.startswith("== ") and "test_gpu_app.py" in line), None)
    if start is None:
        return None
    marks = ""
    for line in lines[start + 1:]:
        body = re.sub(r"\[\s*\d+%\]", "", line.split("==")[0]).strip()  # pytest's "[ 50%]"; "== exit" after a cut
        if not body or set(body) - set(".FEsxX"):
            break
        marks += body
        if "==" in line:
            break
    return {"passed": marks.count("."), "failed": marks.count("F") + marks.count("E"), "skipped": marks.count("s"),
            "cut": True} if marks else None


# -- the page -----------------------------------------------------------------------------------
def _num(value, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def _value(r: dict, name: str, fmt: str) -> str:
    span = (r.get("ranges") or {}).get(name)
    return "–".join(fmt.format(v) for v in span) if span else _num(r.get(name), fmt)


def cell(r: dict, name: str, fmt: str, beside: str | None = None, beside_fmt: str = "") -> str:
    """A figure (its range where the record gives one) and, in brackets, its ratio to the limit."""
    text, ratio_text = _value(r, name, fmt), _value(r, beside, beside_fmt) if beside else "–"
    return text if ratio_text == "–" else f"{text} ({ratio_text})"


def _tests_cell(r: dict) -> str:
    t = r.get("gpu_app_tests")
    return "–" if t is None else f"{t['passed']} passed, {t['failed']} failed" + (
        f", {t['skipped']} skipped" if t.get("skipped") else "") + (" (cut at its cap)" if t.get("cut") else "")


def _pair(r: dict, a: str, b: str, fmt: str) -> str:
    return "–" if r.get(a) is None and r.get(b) is None else f"{_num(r.get(a), fmt)} / {_num(r.get(b), fmt)}"


def _tp_cell(r: dict) -> str:
    if not (t := r.get("tp")):
        return "–"
    if "skipped" in t:
        return "skipped"
    n = t["size"]
    return (f"{t[f'b1_tp{n}_ms']:.2f} / {t[f'b64_tp{n}_ms']:.2f} "
            f"({_num(t['b1_speedup'], '{:.2f}x')} / {_num(t['b64_speedup'], '{:.2f}x')})")


COLUMNS = (
    ("date", lambda r: r["date"]),
    ("commit", lambda r: (r.get("commit") or "?")[:9] + ("+" if r.get("dirty") else "")),
    ("device", lambda r: r["device"]),
    ("app tests", _tests_cell),
    ("decode b1 ms/token (x bound)", lambda r: cell(r, "decode_b1_ms", "{:.2f}", "decode_b1_ratio_to_bound", "{:.2f}x")),
    ("decode b64 ms/step (of bound), tok/s", lambda r: ", ".join(
        c for c in (cell(r, "decode_b64_ms", "{:.2f}", "decode_b64_frac_of_bound", "{:.0%}"),
                    cell(r, "decode_b64_tok_s", "{:.0f} tok/s")) if c != "–") or "–"),
    ("decode 8k b4 ms/step (x bound)", lambda r: cell(r, "decode_8k_b4_ms", "{:.2f}", "decode_8k_b4_ratio_to_bound",
                                                      "{:.2f}x")),
    ("decode host us/step b1 / b64, ops b1", lambda r: ", ".join(
        c for c in (_pair(r, "decode_b1_host_us", "decode_b64_host_us", "{:.0f}"),
                    cell(r, "decode_b1_ops_per_step", "{:.0f} ops")) if c != "–") or "–"),
    ("FP8 decode ms b1 / b64 (x bound)", lambda r: "–" if r.get("fp8_decode_b1_ms") is None
     and r.get("fp8_decode_b64_ms") is None else " / ".join(
         cell(r, f"fp8_decode_b{b}_ms", "{:.2f}", f"fp8_decode_b{b}_ratio_to_bound", "{:.2f}x") for b in (1, 64))),
    ("FP8 step vs bf16 b1 / b64", lambda r: _pair(r, "fp8_b1_step_vs_bf16", "fp8_b64_step_vs_bf16", "{:.2f}x")),
    ("LoRA step vs base b32", lambda r: cell(r, "lora_b32_step_vs_base", "{:.2f}x")),
    ("MoE layer ms b1 / b64 (x bound)", lambda r: "–" if r.get("moe_b1_ms") is None and r.get("moe_b64_ms") is None
     else " / ".join(cell(r, f"moe_b{b}_ms", "{:.3f}", f"moe_b{b}_vs_bandwidth_bound", "{:.2f}x") for b in (1, 64))),
    ("MoE grouped vs eager b1 / b64", lambda r: _pair(r, "moe_b1_grouped_vs_eager", "moe_b64_grouped_vs_eager",
                                                      "{:.2f}x")),
    ("ViT 448² img/s (MFU)", lambda r: cell(r, "vit_forward_448_images_per_s", "{:.0f}", "vit_mfu_448", "{:.1%}")),
    ("ViT 1024² img/s (MFU)", lambda r: cell(r, "vit_forward_1024_images_per_s", "{:.1f}", "vit_mfu_1024", "{:.1%}")),
    ("pool 448² img/s (of forward)", lambda r: cell(r, "encoder_pool_448_images_per_s", "{:.0f}",
                                                    "encoder_pool_over_forward_448", "{:.2f}")),
    ("budget vs one per forward 448²", lambda r: cell(r, "encoder_budget_vs_single_448", "{:.2f}x")),
    ("goodput req/s disagg / coloc", lambda r: _pair(r, "serve_disagg_goodput_rps", "serve_colocated_goodput_rps",
                                                     "{:.2f}")),
    ("p99 TTFT ms disagg / coloc", lambda r: _pair(r, "serve_disagg_p99_ttft_ms", "serve_colocated_p99_ttft_ms",
                                                   "{:.0f}")),
    ("transfer GB/s obj store (of HBM)", lambda r: cell(r, "transfer_object_store_gbs", "{:.2f}",
                                                        "transfer_object_store_frac_of_bandwidth", "{:.2%}")),
    ("transfer GB/s gRPC (of HBM)", lambda r: cell(r, "transfer_grpc_gbs", "{:.2f}", "transfer_grpc_frac_of_bandwidth",
                                                   "{:.2%}")),
    ("TP 2 decode ms b1 / b64 (vs TP 1)", _tp_cell),
    ("CLI ready s, first answer ms", lambda r: "–" if r.get("readme_passed") is None else ", ".join(
        [cell(r, "readme_ready_s", "{:.0f} s"), cell(r, "readme_first_answer_ms", "{:.0f} ms"),
         "passed" if r["readme_passed"] else "failed"])),
    ("notes", lambda r: "; ".join(filter(None, [r.get("source"), *(f"{p} failed: {e}" for p, e in
                                                                   (r.get("failed_parts") or {}).items())]))),
)

PAGE = ROOT / "docs" / "gpu-figures.md"  # its text above the table is written by hand
TABLE = "| date |"


def render(records: list[dict]) -> str:
    rows = [r for _, r in sorted(enumerate(records), key=lambda ir: (ir[1]["date"], ir[0]), reverse=True)]
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(f(r)).replace("|", "/") for _, f in COLUMNS) + " |" for r in rows]
    text = PAGE.read_text()
    return text[:text.index(TABLE)] + "\n".join(lines) + "\n"


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=PARTS, default=list(PARTS), help="parts to run (default: all)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth, GB/s (default: by device)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, TFLOP/s (H100/H200 SXM: 989)")
    p.add_argument("--results", type=Path, default=None, help="default: bench/results/gpu.jsonl (cpu.jsonl on CPU)")
    p.add_argument("--markdown", type=Path, default=None, help="default: docs/gpu-figures.md (none on CPU)")
    p.add_argument("--render-only", action="store_true", help="only regenerate the page from --results")
    p.add_argument("--timeout", type=float, default=PART_TIMEOUT_S, help="per subprocess, seconds")
    p.add_argument("--from-log", type=Path, metavar="DIR",
                   help="no run: the record of what `scripts/gpu-check all DIR` finished (brought back here)")
    p.add_argument("--notes", default=None, help="the record's notes (with --from-log)")
    p.add_argument("--commit", default=None,
                   help="with --from-log: the commit the run was at, when this checkout has moved on (default: HEAD)")
    p.add_argument("--serve-requests", type=Path, default=None,
                   help="the serve part's per-request times and stage times: bench/serve.py --result-json")
    ns = p.parse_args(argv)
    results = ns.results or ROOT / "bench" / "results" / ("gpu.jsonl" if ns.device == "cuda" else "cpu.jsonl")
    markdown = ns.markdown or (ROOT / "docs" / "gpu-figures.md" if ns.device == "cuda" else None)
    record, failed = None, {}
    if ns.from_log:
        record = record_from_log(ns.from_log, ns.peak_gbs, ns.peak_tflops)
        if ns.notes:
            record["notes"] = ns.notes
        if ns.commit:
            if (commit := _out(["git", "rev-parse", "--verify", f"{ns.commit}^{{commit}}"])) is None:
                raise SystemExit(f"--commit {ns.commit}: not a commit of this checkout")
            record.update(commit=commit, dirty=False)
    elif not ns.render_only:
        device = device_name(ns.device)
        peak = peaks(None if device == "cpu" else device, ns.peak_gbs, ns.peak_tflops)
        ns.sizes = CUDA_ARGS if ns.device == "cuda" else CPU_ARGS
        record = new_record(device, peak)
        for part in (q for q in PARTS if q in ns.only):
            try:
                record.update(PART_RUNS[part](ns, peak))
                record["parts"].append(part)
            except PartFailed as e:
                record["failed_parts"][part] = str(e)
                if e.figures:  # measured in part
                    record.update(e.figures)
                    record["parts"].append(part)
            except (KeyError, ValueError) as e:
                record["failed_parts"][part] = f"{type(e).__name__}: {e}"
        failed = record["failed_parts"]
    if record is not None:
        results.parent.mkdir(parents=True, exist_ok=True)
        with results.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record))
    if markdown:
        markdown.write_text(render(read_records(results)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
