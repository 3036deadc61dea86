"""Benches that cannot rot: every bench/ script answers `--help`, and finishes its smallest run
(seconds to a minute) ending with its one JSON line, run as a user runs it (`python bench/X.py`).

Elsewhere, and said so here: transfer.py's smallest run is the one tests/gpu/test_gpu_report.py's
serve part makes (one Ray start, not two); serve.py's sweeps (tests/serve/test_bench_serve.py runs its small runs),
soak.py (minutes long by design; tests/serve/test_failover_serve.py runs its smallest soak) and
gpu_report.py (tests/gpu/test_gpu_report.py runs it into a
temporary results file)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
SERVE = pytest.mark.serve
GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SMALLEST = {
    "encoder.py": (["--items", "4"], []),
    "llm.py": (["--prompt-len", "8", "--max-tokens", "4", "--concurrency", "1", "--decode-tokens", "8"], []),
    "dispatch.py": (["--requests", "2"], [SERVE]),
    "load.py": (["--text-layers", "1", "--vision-depth", "1", "--dtypes", "bfloat16", "--roles", "llm,encoder"], []),
    "vit_attention.py": ([], GPU),
    "video_transfer.py": (["--quick"], []),
    "cli.py": (["--free-ports"], [SERVE]),  # `mmserve serve` on the tiny model, every check, the drain (~1 min)
    "grammar.py": (["--quick"], [pytest.mark.skipif(  # both libraries (only the one chosen is a dependency)
        not all(importlib.util.find_spec(m) for m in ("xgrammar", "llguidance")),
        reason="needs xgrammar and llguidance")]),
}
ELSEWHERE = {"serve.py": "tests/serve/test_bench_serve.py",
             "soak.py": "tests/serve/test_failover_serve.py runs its smallest soak (mmserve.loadgen.soak)",
             "ingress.py": "minutes (a server per mode): tests/serve/test_ingress_modes.py launches the modes",
             "transfer.py": "tests/gpu/test_gpu_report.py (the report's serve part runs its smallest run)",
             "gpu_report.py": "tests/gpu/test_gpu_report.py (its runs append to a results file)",
             "serve_routing.py": "minutes (two apps a workload): bench/serve.py --compare routing runs it",
             "serve_video.py": "minutes (720p clips): bench/serve.py --video runs it",
             "llm_tp.py": "test_tensor_parallel_quick_run_sets_tp2_beside_tp1 runs it as bench/llm.py --tensor-parallel-size 2",
             "moe.py": "test_moe_quick_run_times_both_paths_once_they_agree runs it as bench/llm.py --moe"}


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}  # their own Ray
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, str(BENCH / script), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_every_script_is_covered_or_said_to_be_elsewhere():
    assert set(SCRIPTS) == set(SMALLEST) | set(ELSEWHERE)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    out = _run(script, "--help", timeout=120)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("script, args", [pytest.param(s, a, marks=m, id=s) for s, (a, m) in SMALLEST.items()])
def test_smallest_run_ends_with_its_json_line(script, args):
    out = _run(script, *args, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict) and result


@pytest.mark.parametrize("argv, script, passed", [
    (["--compare", "routing", "--quick"], "serve_routing.py", ["--compare", "routing", "--quick"]),
    (["--video", "--num-cpus", "4"], "serve_video.py", ["--video", "--num-cpus", "4"]),
    (["--compare", "ingress", "--quick"], "ingress.py", ["--quick"]),
])
def test_serve_runs_its_experiments_as_their_own_scripts(monkeypatch, argv, script, passed):
    """bench/serve.py --compare routing | ingress, --video: the sibling script in its place (no bench imports another)."""
    from bench import serve

    def execv(path, args):
        raise SystemExit(args)

    monkeypatch.setattr(serve.os, "execv", execv)
    with pytest.raises(SystemExit) as done:
        serve.main(argv)
    assert done.value.code == [sys.executable, str(BENCH / script), *passed]


def test_load_of_a_quantized_tiny_counts_its_quantized_bytes():
    """`load.py --tiny --quantization fp8-block` (~20 s): the LLM replica holds the FP8 weights and
    their scales beside the dense embeddings, the encoder nothing quantized."""
    out = _run("load.py", "--tiny", "--quantization", "fp8-block", "--dtypes", "bfloat16", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    llm, encoder = result["rows"]
    assert result["quantization"] == "fp8-block" and (llm["role"], encoder["role"]) == ("llm", "encoder")
    assert 0 < llm["quantized_gb"] < llm["weights_gb"] and encoder["quantized_gb"] == 0


def test_breakdown_reports_every_phase_for_each_case_both_ways():
    """`llm.py --breakdown` (seconds with 4 steps): a row per case and overlap mode, host time below the step."""
    out = _run("llm.py", "--breakdown", "--steps", "4", "--prompt-len", "8", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for case in ("decode_b1", "decode_b8", "decode_b64", "mixed_b8"):
        for mode in ("off", "on"):
            assert 0 < result[f"{case}_{mode}_host_us"] < result[f"{case}_{mode}_step_us"]
            assert result[f"{case}_{mode}_ops"] > 0
    assert "schedule" in out.stdout and "postprocess" in out.stdout


def test_grammar_run_sets_both_ratios_with_the_grammars_own_work_apart():
    """`llm.py --grammar` (~20 s with one round of 6 tokens): both step ratios per batch, and on the
    CPU the same-forward ratio made of the printed medians, with mask time counted. (Which side's rest
    is dearer is not asserted: a busy host staggers a short run's admissions, so its steady steps
    may hold fewer rows on one side; CI once had no step of all 64.)"""
    out = _run("llm.py", "--grammar", "--grammar-rounds", "1", "--decode-tokens", "6", "--prompt-len", "8",
               "--grammar-threads", "2", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["vocab"] == 151936 and not r["overlap"] and r["lm"] == "small" and r["fill_threads"] == 2
    assert "mask fill: 2 threads" in out.stdout
    for b in (1, 64):
        wall = r[f"grammar_ms_per_step_b{b}"] / r[f"none_ms_per_step_b{b}"]
        assert r[f"grammar_b{b}_step_ratio"] == pytest.approx(wall, abs=2e-3)
        f, plain, constrained = r[f"forward_ms_b{b}"], r[f"none_rest_ms_b{b}"], r[f"grammar_rest_ms_b{b}"]
        assert r[f"grammar_b{b}_same_forward_ratio"] == pytest.approx((f + constrained) / (f + plain), abs=2e-3)
        assert f > 0 and plain > 0 and constrained > 0 and r[f"mask_ms_per_step_b{b}"] > 0
        assert r[f"fill_ms_per_row_b{b}"] >= 0  # (a CPU fills a greedy row only where its token is refused)


def test_lora_run_sets_the_mixed_batch_beside_the_base_model():
    """`llm.py --lora` (seconds with one round of 6 tokens): batch 32 over 4 adapters of rank 16
    against the base model, both timed, the ratio theirs."""
    out = _run("llm.py", "--lora", "--lora-rounds", "1", "--decode-tokens", "6", "--prompt-len", "8", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert (r["device"], r["lora_adapters"], r["lora_rank"], r["lora_batch"]) == ("cpu", 4, 16, 32)
    assert r["lora_step_ms"] > 0 and r["base_step_ms"] > 0 and r["lora_step_ratio"] > 0
    assert r["lora_step_ratio"] == pytest.approx(r["lora_step_ms"] / r["base_step_ms"], abs=2e-3)
    assert "lora / base:" in out.stdout


def test_tensor_parallel_quick_run_sets_tp2_beside_tp1():
    """`llm.py --tensor-parallel-size 2 --quick` (~10 s; bench/llm_tp.py in its place): both sizes
    timed at batch 1 and 64, rank 0 holds part of the weights and half the KV, 2 all-reduces a layer and one for the embedding."""
    out = _run("llm.py", "--tensor-parallel-size", "2", "--quick", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tensor_parallel_size"] == 2 and result["all_reduces_per_step"] == 2 * 4 + 1  # 4 layers, the embedding
    assert result["rank0_weight_bytes"] < result["weight_bytes"]
    assert result["rank0_kv_bytes_per_token"] * 2 == result["kv_bytes_per_token"]
    for batch in (1, 64):
        assert result[f"tp1_ms_per_step_b{batch}"] > 0 and result[f"tp2_ms_per_step_b{batch}"] > 0
        assert 0 < result[f"tp2_collective_share_b{batch}"] < 1
    assert 0 < result["tp2_message_bytes_b1"] < result["tp2_message_bytes_b64"]


def test_hybrid_prefix_quick_run_resumes_the_second_request():
    """`llm.py --hybrid-prefix --quick` (seconds): the second request resumes after the image."""
    out = _run("llm.py", "--hybrid-prefix", "--quick", "--repeats", "1", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["cached_tokens_second_on"] == result["system_tokens"] + result["image_tokens"]
    assert result["hybrid_prefix_ttft_speedup"] > 0 and result["snapshot_mb"] > 0


def test_moe_quick_run_times_both_paths_once_they_agree():
    """`llm.py --moe --quick` (seconds; bench/moe.py in its place): the engine's grouped experts and
    transformers' loop agree on the layer's output, then both are timed at batch 1 and 64 beside the
    floor of reading the touched experts' weights."""
    out = _run("llm.py", "--moe", "--quick", "--repeats", "1", "--inputs", "2", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["moe_paths_agree"] is True and result["moe_engine_path"] == "grouped"
    for batch in (1, 64):
        assert result[f"moe_b{batch}_eager_ms"] > 0 and result[f"moe_b{batch}_grouped_ms"] > 0
        assert result[f"moe_b{batch}_grouped_vs_eager"] == pytest.approx(
            result[f"moe_b{batch}_eager_ms"] / result[f"moe_b{batch}_grouped_ms"], rel=0.01)
        assert result[f"moe_b{batch}_floor_ms"] > 0
    per_expert = result["expert_weight_bytes"] // result["num_experts"]
    assert result["moe_b1_bytes_touched"] == result["num_experts_per_tok"] * per_expert  # one token: its top k
    assert result["moe_b1_bytes_touched"] < result["moe_b64_bytes_touched"] <= result["expert_weight_bytes"]


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_video_bench_counts_the_cpu_seconds_a_busy_thread_spends(monkeypatch, tmp_path):
    """The video bench's CPU floor (serve_video.cpu_busy_s): the machine's busy seconds hold at least
    this thread's busy work (whatever else the machine runs: Ray replicas, other processes), and
    are /proc/stat's ticks but idle and I/O wait (an idle wait adds none)."""
    import builtins
    import time

    from bench.serve_video import cpu_busy_s

    before, own = cpu_busy_s(), time.process_time()
    while time.process_time() - own < 0.3:  # 0.3 s of this thread's CPU, however long a loaded box takes
        pass
    assert cpu_busy_s() - before >= 0.8 * (time.process_time() - own)
    ticks = os.sysconf("SC_CLK_TCK")  # /proc/stat's lines: user nice system idle iowait irq softirq steal ...
    lines = iter([f"cpu  {ticks} 0 {ticks} 500 7 0 0 0 0 0\n",
                  f"cpu  {ticks} 0 {ticks} {500 + 2 * ticks} {7 + ticks} 0 0 0 0 0\n",  # idle and waiting
                  f"cpu  {3 * ticks} 0 {ticks} {500 + 2 * ticks} {7 + ticks} 0 0 0 0 0\n"])  # 2 s of user time
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        if path != "/proc/stat":
            return real_open(path, *args, **kwargs)
        (tmp_path / "stat").write_text(next(lines))
        return real_open(tmp_path / "stat")

    monkeypatch.setattr(builtins, "open", fake_open)
    first, idle, busy = cpu_busy_s(), cpu_busy_s(), cpu_busy_s()
    assert first == 2.0 and idle == first and busy == first + 2  # idle and iowait ticks count not, user ticks do


def test_encoder_bench_ceiling_is_the_forward_at_the_measured_matmul_and_attention_rates():
    """bench/encoder.py's ceiling (the GPU rows print it beside each MFU), here on a small tower on CPU."""
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    from bench.encoder import ceiling, flops_by_kind

    config = Qwen2VLVisionConfig(depth=2, embed_dim=64, num_heads=4, hidden_size=96)
    grid = (1, 16, 16)
    images_per_s, matmul_tflops, attention_tflops = ceiling(config, grid, 3, torch.float32, torch.device("cpu"))
    matmul, attention = flops_by_kind(config, grid)
    assert matmul == 2 * 24 * 64 ** 2 * 256 + 2 * 64 * 256 * 256 + 2 * 64 * 256 * 96  # blocks + merger
    assert attention == 2 * 4 * 256 * 256 * 64
    assert matmul_tflops > 0 and attention_tflops > 0
    assert images_per_s == pytest.approx(1e12 / (matmul / matmul_tflops + attention / attention_tflops))


def test_quantized_run_sets_the_quantized_lm_beside_the_dense_one():
    """`llm.py --quantization fp8-block` on the CPU (the small LM, float32: the dequantizing path):
    decode at batch 1 and 64 of the dense LM and of its block-FP8 copy, their ratio, the weights as held."""
    out = _run("llm.py", "--quantization", "fp8-block", "--prompt-len", "8", "--decode-tokens", "8", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["quantization"] == "fp8-block" and result["gemm"] == "dequantize" and result["block"] == [64, 128]
    assert result["quantized_weight_bytes"] < 0.6 * result["dense_weight_bytes"]  # e4m3 projections, fp32 embeddings
    for batch in (1, 64):
        assert result[f"quantized_b{batch}_step_ratio"] == pytest.approx(
            result[f"quantized_b{batch}_ms"] / result[f"dense_b{batch}_ms"], rel=0.01)
        assert result[f"dense_b{batch}_bound_ms"] is None  # no bandwidth known for a CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_gpu_check_finds_the_gpu_test_files_and_refuses_without_a_gpu():
    """scripts/gpu-check (the GPU host's runbook): with Ray importable it installs nothing, and
    without a CUDA device it stops before running anything, saying so; its test files are every
    file holding a gpu or kernel test."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), "tests"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "no CUDA device here" in done.stderr, done.stderr
    marked = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
              if "pytest.mark.gpu" in p.read_text() or "pytest.mark.kernel" in p.read_text()}
    listed = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), "list"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=True).stdout.split()
    assert set(listed) == marked and "tests/gpu/test_gpu_app.py" in marked


def test_the_test_paths_the_gpu_runbooks_name_exist():
    """scripts/gpu-check and bench/gpu_report.py name test files by path: only a GPU run would
    otherwise notice one that moved."""
    named = {m for script in ("scripts/gpu-check", "bench/gpu_report.py")
             for m in re.findall(r"tests/[\w/]+\.py", (ROOT / script).read_text())}
    assert named and sorted(n for n in named if not (ROOT / n).is_file()) == []


def test_the_cli_check_runs_the_readmes_own_curl_block():
    """bench/cli.py (scripts/gpu-check cli) runs the README's curl as written, on the port it serves on."""
    from bench.cli import readme_curl

    block = readme_curl(8123)
    assert block.startswith("IMG=") and "curl -s localhost:8123/v1/chat/completions" in block
    assert '"max_tokens": 16' in block and "localhost:8000" not in block
