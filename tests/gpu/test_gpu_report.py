"""bench/gpu_report.py, the one command for every GPU figure, checked on CPU: its record's shape
(every figure in every record, null where not measured), its bounds, its page, the seeded history,
and the full-size checkpoint its GPU parts serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_report import (FIGURES, engine_figures, fp8_figures, moe_figures, read_records, render,
                               transfer_figures)
from mmserve.loadgen.device_peaks import Peaks, peaks

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = (
    "device", "gpu_app_tests", "decode_b1_ms", "decode_b1_ratio_to_bound", "decode_b64_frac_of_bound",
    "decode_8k_b4_ratio_to_bound", "vit_mfu_448", "vit_mfu_1024", "encoder_pool_over_forward_448",
    "encoder_budget_vs_single_448", "serve_disagg_goodput_rps", "serve_colocated_goodput_rps",
    "serve_disagg_p99_ttft_ms", "serve_colocated_p99_ttft_ms",
)
HEADER = ("date", "commit", "device", "driver", "torch", "triton", "transformers", "units")


def _report(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_report.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _check_shape(record: dict) -> None:
    assert all(name in record for name in (*REQUIRED, *HEADER))
    assert all(f.name in record for f in FIGURES)  # measured or null, never left out
    assert set(record["units"]) == {f.name for f in FIGURES}


def test_cpu_run_of_two_parts_appends_one_record_with_every_figure(tmp_path):
    results, page = tmp_path / "cpu.jsonl", tmp_path / "figures.md"
    out = _report("--device", "cpu", "--only", "tests", "engine", "--results", str(results), "--markdown", str(page))
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = read_records(results)
    _check_shape(record)
    assert record["device"] == "cpu" and record["parts"] == ["tests", "engine"] and not record["failed_parts"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert record["commit"] == head and record["torch"] and record["transformers"]
    tests = record["gpu_app_tests"]
    assert (tests["passed"], tests["failed"]) == (0, 0) and tests["skipped"] > 0  # no CUDA: all skipped
    assert record["decode_b1_ms"] > 0 and record["decode_b64_ms"] > 0
    # (host time is a figure, not a bound: b1 < b64 held on a quiet box, not on a shared one, 4 steps each)
    assert record["decode_b1_host_us"] > 0 and record["decode_b64_host_us"] > 0 and record["decode_b1_ops_per_step"] > 0
    assert record["moe_b1_ms"] > 0 and record["moe_b64_ms"] > 0 and record["moe_b64_grouped_vs_eager"] > 0
    # no memory bandwidth known for a CPU, no 8k context at CPU sizes, parts not run: null
    unmeasured = [f.name for f in FIGURES if f.part in ("encoder", "serve")] + [
        "decode_b1_bound_ms", "decode_b1_ratio_to_bound", "decode_b64_frac_of_bound", "decode_8k_b4_ms",
        "decode_8k_b4_ratio_to_bound", "moe_b1_vs_bandwidth_bound", "moe_b64_vs_bandwidth_bound"]
    assert all(record[name] is None for name in unmeasured)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == record
    assert page.read_text() == render([record])


def test_decode_bounds_read_the_weights_once_and_every_sequences_kv():
    bench = {"weight_bytes": 3_000_000_000, "kv_bytes_per_token": 28_672, "prompt_len": 64, "decode_tokens": 128,
             "decode_ms_per_token_b1": 4.0, "decode_ms_per_step_b64": 6.0, "engine_tok_s_b64": 9000.0,
             "long_context": 8192, "long_batch": 4, "decode_ms_per_step_long": 2.5}
    f = engine_figures(bench, Peaks(3000, 989))
    kv_b1 = 1 * (64 + 64) * 28_672
    assert f["decode_b1_bound_ms"] == pytest.approx((3e9 + kv_b1) / 3e12 * 1e3, rel=1e-3)
    assert f["decode_b1_ratio_to_bound"] == pytest.approx(4.0 / f["decode_b1_bound_ms"], rel=1e-3)
    assert f["decode_b64_frac_of_bound"] == pytest.approx(f["decode_b64_bound_ms"] / 6.0, rel=1e-3)
    assert f["decode_b64_frac_of_bound"] < 1
    assert f["decode_8k_b4_bound_ms"] == pytest.approx((3e9 + 4 * (8192 + 64) * 28_672) / 3e12 * 1e3, rel=1e-3)
    assert f["decode_8k_b4_ratio_to_bound"] == pytest.approx(2.5 / f["decode_8k_b4_bound_ms"], rel=1e-3)
    other_context = engine_figures({**bench, "long_context": 4096}, Peaks(3000, 989))
    assert other_context["decode_8k_b4_ms"] is None  # only an 8k, batch-4 run is that figure
    assert engine_figures(bench, Peaks(None, None))["decode_b1_ratio_to_bound"] is None


def test_moe_layer_is_set_against_reading_the_touched_experts_at_peak_bandwidth():
    bench = {"device": "cuda", "moe_b1_bytes_touched": 75_497_472, "moe_b64_bytes_touched": 1_189_085_184,
             "moe_b1_triton_ms": 0.05, "moe_b64_triton_ms": 0.5, "moe_b1_grouped_ms": 0.2, "moe_b64_grouped_ms": 0.9,
             "moe_b1_grouped_vs_eager": 3.0, "moe_b64_grouped_vs_eager": 2.5}
    f = moe_figures(bench, Peaks(3350, 989))
    assert (f["moe_b1_ms"], f["moe_b64_ms"]) == (0.05, 0.5)  # the engine's CUDA path: the Triton kernel
    assert f["moe_b1_vs_bandwidth_bound"] == pytest.approx(0.05 / (75_497_472 / 3.35e12 * 1e3), rel=1e-2)
    assert f["moe_b64_vs_bandwidth_bound"] == pytest.approx(0.5 / (1_189_085_184 / 3.35e12 * 1e3), rel=1e-2)
    assert (f["moe_b1_grouped_vs_eager"], f["moe_b64_grouped_vs_eager"]) == (3.0, 2.5)
    no_triton = moe_figures({k: v for k, v in bench.items() if "triton" not in k}, Peaks(3350, 989))
    assert no_triton["moe_b64_ms"] is None and no_triton["moe_b64_vs_bandwidth_bound"] is None
    cpu = moe_figures({**bench, "device": "cpu"}, Peaks(None, None))
    assert cpu["moe_b64_ms"] == 0.9 and cpu["moe_b64_vs_bandwidth_bound"] is None


FP8_RUN = {"device": "cuda", "quantization": "fp8-block", "prompt_len": 64, "decode_tokens": 128,
           "kv_bytes_per_token": 28_672, "dense_weight_bytes": 4_400_000_000, "quantized_weight_bytes": 2_000_000_000,
           "dense_b1_ms": 2.8, "dense_b64_ms": 3.3, "quantized_b1_ms": 2.5, "quantized_b64_ms": 2.0,
           "quantized_b1_step_ratio": 0.893, "quantized_b64_step_ratio": 0.606}


def test_fp8_decode_is_set_against_its_own_bound_and_beside_the_bf16_step():
    f = fp8_figures(FP8_RUN, Peaks(4800, 989))
    kv_b64 = 64 * (64 + 64) * 28_672
    assert (f["fp8_decode_b1_ms"], f["fp8_decode_b64_ms"]) == (2.5, 2.0)
    assert f["fp8_decode_b64_ratio_to_bound"] == pytest.approx(2.0 / ((2e9 + kv_b64) / 4.8e12 * 1e3), rel=1e-3)
    assert (f["fp8_b1_step_vs_bf16"], f["fp8_b64_step_vs_bf16"]) == (0.893, 0.606)
    assert fp8_figures({**FP8_RUN, "quantization": "awq"}, Peaks(4800, 989)) == {}  # another format: not these
    assert fp8_figures(FP8_RUN, Peaks(None, None))["fp8_decode_b1_ratio_to_bound"] is None


def test_a_record_from_the_log_of_a_gpu_check_quantized_run(tmp_path):
    """`scripts/gpu-check quantized DIR` runs `benches DIR S fp8`: its bench.log gives the FP8 figures."""
    host = {"device": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0", "triton": "3.6.0",
            "transformers": "5.17.0"}
    (tmp_path / "bench.log").write_text("\n".join([
        "# host " + json.dumps(host), "== python3 bench/llm.py --device cuda --quantization=fp8-block (cap 240 s)",
        "table lines", json.dumps(FP8_RUN), "== exit 0 after 150 s: python3 bench/llm.py --device"]) + "\n")
    results = tmp_path / "gpu.jsonl"
    out = _report("--from-log", str(tmp_path), "--results", str(results), "--markdown", str(tmp_path / "page.md"))
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = read_records(results)
    _check_shape(record)
    assert record["parts"] == ["engine"] and not record["failed_parts"]
    assert record["fp8_b64_step_vs_bf16"] == 0.606 and record["decode_b1_ms"] is None
    assert "0.61x" in (tmp_path / "page.md").read_text()


def test_cpu_run_of_the_tp_part_sets_tp2_beside_tp1(tmp_path):
    """`--only tp` on the CPU: bench/llm_tp.py's quick run (two local ranks) in the record's `tp`;
    no bandwidth known for a CPU, so no bounds; the page shows the TP 2 column."""
    results, page = tmp_path / "cpu.jsonl", tmp_path / "figures.md"
    out = _report("--device", "cpu", "--only", "tp", "--results", str(results), "--markdown", str(page))
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = read_records(results)
    _check_shape(record)
    tp = record["tp"]
    assert record["parts"] == ["tp"] and tp["size"] == 2
    for b in (1, 64):
        assert tp[f"b{b}_tp1_ms"] > 0 and tp[f"b{b}_tp2_ms"] > 0 and tp[f"b{b}_speedup"] > 0
        assert tp[f"b{b}_tp2_bound_ms"] is None and 0 < tp[f"b{b}_collective_share"] < 1
    assert "TP 2 decode ms" in page.read_text()


def test_tp_part_is_skipped_with_fewer_than_two_gpus_and_bounded_by_rank_0s_share(monkeypatch):
    from types import SimpleNamespace

    from bench import gpu_report

    monkeypatch.setattr(gpu_report, "_out", lambda cmd: "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-x)")
    ns = SimpleNamespace(device="cuda", sizes=gpu_report.CUDA_ARGS, timeout=1)
    assert gpu_report.tp_part(ns, peaks("NVIDIA H100 80GB HBM3")) == {"tp": {"skipped": "needs >= 2 GPUs, found 1"}}
    r = {"tensor_parallel_size": 2, "prompt_len": 60, "steps": 8, "weight_bytes": 3e9, "kv_bytes_per_token": 1000,
         "rank0_weight_bytes": 2e9, "rank0_kv_bytes_per_token": 500}
    for b in (1, 64):
        r.update({f"tp1_ms_per_step_b{b}": 2.0, f"tp2_ms_per_step_b{b}": 1.6, f"tp2_collective_share_b{b}": 0.2,
                  f"tp2_message_bytes_b{b}": 100 * b})
    tp = gpu_report.tp_figures(r, Peaks(memory_gbs=1000.0, bf16_tflops=None))["tp"]
    assert tp["b1_tp1_bound_ms"] == pytest.approx((3e9 + 64 * 1000) / 1e12 * 1e3, abs=1e-4)  # context 60 + 8 / 2
    assert tp["b64_tp2_bound_ms"] == pytest.approx((2e9 + 64 * 64 * 500) / 1e12 * 1e3, abs=1e-4)
    assert tp["b1_speedup"] == 1.25 and tp["b64_tp2_ratio_to_bound"] == pytest.approx(1.6 / tp["b64_tp2_bound_ms"], rel=1e-3)
    cell = dict(gpu_report.COLUMNS)["TP 2 decode ms b1 / b64 (vs TP 1)"]
    assert cell({"tp": tp}) == "1.60 / 1.60 (1.25x / 1.25x)" and cell({"tp": {"skipped": "x"}}) == "skipped"
    assert cell({}) == "–"


def test_transfer_is_set_against_the_memory_bandwidth():
    f = transfer_figures({"object_store_mb_s_20mb": 2500.0, "grpc_mb_s_20mb": 800.0}, Peaks(3350, 989))
    assert (f["transfer_object_store_gbs"], f["transfer_grpc_gbs"]) == (2.5, 0.8)
    assert f["transfer_object_store_frac_of_bandwidth"] == pytest.approx(2.5 / 3350, rel=1e-3)


def test_peaks_by_the_name_cuda_reports():
    assert peaks("NVIDIA H100 80GB HBM3") == (3350, 989)
    assert peaks("NVIDIA H100 PCIe").memory_gbs == 2000
    assert peaks("NVIDIA H200").memory_gbs == 4800
    assert peaks("NVIDIA L40S").memory_gbs == 864  # not the L4
    assert peaks("NVIDIA H100 80GB HBM3", memory_gbs=3000) == (3000, 989)
    assert peaks("Some Future GPU") == (None, None) and peaks(None, bf16_tflops=100) == (None, 100)


def test_the_page_lists_records_newest_first_with_ratios_and_ranges(tmp_path):
    seed = read_records(ROOT / "bench" / "results" / "gpu.jsonl")[0]
    newer = {**seed, "date": "2027-01-05", "commit": "f" * 40, "dirty": True, "source": None, "ranges": None,
             "failed_parts": {"serve": "bench/serve.py exited 1"}, "gpu_app_tests": {"passed": 9, "failed": 1},
             "decode_b64_ms": 6.5, "decode_b64_frac_of_bound": 0.15, "vit_mfu_448": 0.2}
    results = tmp_path / "gpu.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in (seed, newer)))
    page = tmp_path / "figures.md"
    assert _report("--render-only", "--results", str(results), "--markdown", str(page)).returncode == 0
    rows = [line for line in page.read_text().splitlines() if line.startswith("| 20")]
    assert [r.split(" | ")[0] for r in rows] == ["| 2027-01-05", "| 2026-11-22"]
    assert "fffffffff+" in rows[0] and "9 passed, 1 failed" in rows[0] and "serve failed" in rows[0]
    assert "6.50 (15%)" in rows[0] and "(20.0%)" in rows[0]
    assert "3.95 (4.29x)" in rows[1] and "112–130 (17.0%–20.0%)" in rows[1] and "transcribed" in rows[1]


def test_the_seeded_history_is_the_h100_transcription_and_the_page_is_generated():
    seed, *measured = read_records(ROOT / "bench" / "results" / "gpu.jsonl")
    _check_shape(seed)
    for record in measured:  # runs on a GPU since: every figure in each, from a device's run
        _check_shape(record)
        assert record["device"].startswith("NVIDIA") and record["parts"] and record["date"] > seed["date"]
    assert (seed["date"], seed["commit"], seed["device"]) == ("2026-11-22", "87982b6", "NVIDIA H100 80GB HBM3")
    assert seed["source"] == "transcribed from docs/attention.md"
    assert (seed["decode_b1_ms"], seed["vit_mfu_1024"], seed["vit_forward_1024_images_per_s"]) == (3.95, 0.215, 17.9)
    never_measured = ("gpu_app_tests", "decode_b64_frac_of_bound", "decode_8k_b4_ratio_to_bound",
                      "encoder_budget_vs_single_448", "serve_disagg_goodput_rps", "transfer_grpc_gbs")
    assert all(seed[name] is None for name in never_measured)
    assert (ROOT / "docs" / "gpu-figures.md").read_text() == render(read_records(ROOT / "bench" / "results" / "gpu.jsonl"))


def test_the_full_size_checkpoint_has_qwen2_vl_2bs_shapes_and_serves(tmp_path, monkeypatch):
    """Shrunk in depth (CPU): the builder's config, processor and tokenizer load as the app loads them.
    Two callers at once (scripts/gpu-check's background build and a test's fixture): one builds."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoConfig, AutoProcessor

    import mmserve.loadgen.checkpoints as checkpoints
    from encoder_service import VisionEncoder
    from llm_service.model.language_model import LanguageModel
    from mmserve.loadgen.checkpoints import QWEN2_VL_2B_TEXT, qwen2_vl_2b

    builds, build = [], checkpoints._build
    monkeypatch.setattr(checkpoints, "_build", lambda *a, **k: builds.append(1) or build(*a, **k))
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: qwen2_vl_2b(tmp_path / "q2b", text_layers=1, vision_depth=1), range(2)))
    assert len(builds) == 1 and paths[0] == paths[1]
    path = paths[0]
    config = AutoConfig.from_pretrained(path)
    assert {k: getattr(config.text_config, k) for k in QWEN2_VL_2B_TEXT} == {**QWEN2_VL_2B_TEXT, "num_hidden_layers": 1}
    assert (config.vision_config.embed_dim, config.vision_config.hidden_size) == (1280, 1536)
    assert AutoProcessor.from_pretrained(path).image_processor.size["longest_edge"] == 12845056
    lm = LanguageModel(path, dtype="bfloat16")
    assert lm.vocab_size == 151936 and VisionEncoder(path, dtype="bfloat16").tower is not None
    stamp = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert qwen2_vl_2b(tmp_path / "q2b", text_layers=1, vision_depth=1) == path  # built once
    assert (Path(path) / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.serve
def test_cpu_run_of_the_serve_part_fills_the_serve_figures(tmp_path):
    results = tmp_path / "cpu.jsonl"
    out = _report("--device", "cpu", "--only", "serve", "--results", str(results), timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = read_records(results)
    _check_shape(record)
    serve = [f.name for f in FIGURES if f.part == "serve" and "frac" not in f.name]
    assert all(record[name] is not None for name in serve)
    assert record["transfer_grpc_frac_of_bandwidth"] is None  # no memory bandwidth known for a CPU


def test_a_record_from_the_logs_of_a_gpu_check_all_run(tmp_path):
    """`scripts/gpu-check all DIR` leaves logs (a device call returns files, not the GPU host's
    results file): --from-log makes the record of what finished; a bench that started and left no
    result is named as failed, one that never started (not in the call's list) is not."""
    llm = {"device": "cuda", "weight_bytes": 3087428608, "kv_bytes_per_token": 28672, "prompt_len": 64,
           "decode_tokens": 128, "decode_ms_per_token_b1": 2.794, "decode_ms_per_step_b64": 3.29,
           "engine_tok_s_b64": 17746.4, "long_context": 8192, "long_batch": 4, "decode_ms_per_step_long": 3.457}
    moe = {"device": "cuda", "moe_engine_path": "triton", "moe_b1_triton_ms": 0.7233, "moe_b64_triton_ms": 0.7278,
           "moe_b1_bytes_touched": 75497472, "moe_b64_bytes_touched": 1186725888, "moe_b1_grouped_vs_eager": 4.111,
           "moe_b64_grouped_vs_eager": 47.94}
    host = {"device": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0", "triton": "3.6.0",
            "transformers": "5.17.0"}
    (tmp_path / "bench.log").write_text("\n".join([
        "# host " + json.dumps(host), "== python3 bench/llm.py --device cuda (cap 150 s)", "table lines",
        json.dumps(llm), "== python3 bench/llm.py --device cuda --moe (cap 60 s)", json.dumps(moe),
        "== python3 bench/llm.py --device cuda --breakdown --steps 64 (cap 45 s)",
        "== exit 124 after 45 s: python3 bench/llm.py",
        "== python3 bench/gpu_report.py --only serve --results r --markdown /dev/null (cap 300 s)",
        json.dumps({"parts": [], "failed_parts": {"serve": "bench/serve.py exited 1 without its JSON line"}}),
        "== exit 1 after 68 s: python3 bench/gpu_report.py --only"]) + "\n")
    (tmp_path / "junit-app.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3">'
        '<testcase classname="tests.gpu.test_gpu_app" name="a"/>'
        '<testcase classname="tests.gpu.test_gpu_app" name="b"><error message="x"/></testcase>'
        '<testcase classname="tests.gpu.test_gpu_app" name="c"><skipped message="y"/></testcase>'
        '<testcase classname="tests.gpu.test_fused_ops" name="d"><failure message="z"/></testcase>'
        '</testsuite></testsuites>')
    results = tmp_path / "gpu.jsonl"
    out = _report("--from-log", str(tmp_path), "--results", str(results), "--markdown", str(tmp_path / "page.md"),
                  "--notes", "a test")
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = read_records(results)
    _check_shape(record)
    assert {k: record[k] for k in host} == host and record["peak_gbs"] == 4800 and record["notes"] == "a test"
    assert record["parts"] == ["tests", "engine"]
    assert record["gpu_app_tests"] == {"passed": 1, "failed": 1, "skipped": 1}  # test_gpu_app's cases only
    assert record["decode_b1_ms"] == 2.794 and record["decode_b1_ratio_to_bound"] == pytest.approx(4.34, abs=0.01)
    assert record["moe_b64_ms"] == 0.7278 and record["vit_mfu_448"] is None and record["grammar_b1_step_ratio"] is None
    missing = record["failed_parts"]["engine"]
    assert "--breakdown" in missing and "--grammar" not in missing and "--moe" not in missing
    assert record["failed_parts"]["serve"] == "bench/serve.py exited 1 without its JSON line"
    assert "NVIDIA H200" in (tmp_path / "page.md").read_text()


def test_a_record_from_a_run_cut_at_its_caps(tmp_path):
    """The H200 run of 2026-11-26: the app tests cut before their junit file (counts read off the
    progress line), the serve part cut in bench/transfer.py after bench/serve.py printed its line (the
    serve figures are kept, the transfer ones named missing); --commit: the run's commit."""
    host = {"device": "NVIDIA H200", "driver": "580.159.04", "torch": "2.11.0", "triton": "3.6.0",
            "transformers": "5.17.0"}
    serve = {"disagg_goodput_rps": 6.38, "disagg_p99_ttft_ms": 254.4, "colocated_goodput_rps": 3.9,
             "colocated_p99_ttft_ms": 333.3, "device": "cuda"}
    (tmp_path / "tests.log").write_text("\n".join([
        "# host " + json.dumps(host), "== python3 -m pytest -q tests/gpu/test_gpu_app.py (cap 270 s)",
        "." * 21 + "EEEEEEE== exit 124 after 273 s: python3 -m pytest"]) + "\n")
    (tmp_path / "bench.log").write_text("\n".join([
        "# host " + json.dumps(host),
        "== python3 bench/gpu_report.py --only serve --results r --markdown /dev/null (cap 289 s)",
        json.dumps(serve), "== exit 124 after 289 s: python3 bench/gpu_report.py --only"]) + "\n")
    results = tmp_path / "gpu.jsonl"
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()[0]
    out = _report("--from-log", str(tmp_path), "--results", str(results), "--markdown", str(tmp_path / "page.md"),
                  "--commit", first[:9])
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = read_records(results)
    _check_shape(record)
    assert record["commit"] == first and record["dirty"] is False
    assert record["parts"] == ["tests", "serve"]
    assert record["gpu_app_tests"] == {"passed": 21, "failed": 7, "skipped": 0, "cut": True}
    assert (record["serve_disagg_goodput_rps"], record["serve_colocated_p99_ttft_ms"]) == (6.38, 333.3)
    assert record["transfer_grpc_gbs"] is None and "bench/transfer.py" in record["failed_parts"]["serve"]
    assert "21 passed, 7 failed (cut at its cap)" in (tmp_path / "page.md").read_text()


def test_a_record_from_the_logs_of_a_gpu_check_cli_run(tmp_path):
    """`scripts/gpu-check cli DIR`: bench/cli.py's line gives readme_ready_s, readme_first_answer_ms and
    readme_passed; a failed check is named in failed_parts; a run cut before its line says so."""
    host = {"device": "NVIDIA H100 80GB HBM3", "driver": "580.1", "torch": "2.11.0", "triton": "3.6.0",
            "transformers": "5.17.0"}
    cli = {"readme_ready_s": 71.4, "readme_first_answer_ms": 640, "readme_passed": False,
           "checks": {"ready": True, "readme_curl": True, "chat_grpc": "exit 1: error UNAVAILABLE"},
           "gpu_shares": {"Encoder": 0.1, "LLM": 0.9}}
    start = "== python3 bench/cli.py --model /tmp/q2b --dtype bfloat16 --deadline-s 300 --log x (cap 420 s)"
    (tmp_path / "bench.log").write_text("\n".join(["# host " + json.dumps(host), start, json.dumps(cli)]) + "\n")
    results = tmp_path / "gpu.jsonl"
    out = _report("--from-log", str(tmp_path), "--results", str(results), "--markdown", str(tmp_path / "page.md"))
    assert out.returncode == 0, out.stderr[-3000:]
    (record,) = read_records(results)
    _check_shape(record)
    assert record["parts"] == ["cli"]
    assert (record["readme_ready_s"], record["readme_first_answer_ms"], record["readme_passed"]) == (71.4, 640, False)
    assert record["failed_parts"] == {"cli": "chat_grpc: exit 1: error UNAVAILABLE"}
    assert "71 s, 640 ms, failed" in (tmp_path / "page.md").read_text()
    (tmp_path / "bench.log").write_text("\n".join(["# host " + json.dumps(host), start]) + "\n")
    out = _report("--from-log", str(tmp_path), "--results", str(results), "--markdown", str(tmp_path / "page.md"))
    assert out.returncode == 0, out.stderr[-3000:]
    cut = read_records(results)[-1]
    assert cut["readme_passed"] is None and "bench/cli.py" in cut["failed_parts"]["cli"]
