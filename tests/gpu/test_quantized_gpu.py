"""Quantized checkpoints on CUDA: the tiny Qwen2-VL in each format, served by the engine in bfloat16
with its GEMMs on the stored tensors (block FP8 in Triton and per-channel FP8 through
`torch._scaled_mm` with per-token activation scales, on compute capability >= 9.0; AWQ in the
W4A16 Triton GEMM), inside the decode CUDA graphs.

Activation quantization changes the numbers, so the reference is `transformers`' monolithic model
on the same checkpoint dequantized, run in bf16 with the same per-token activation quantization
applied to the input of every quantized projection (forward pre-hooks, `mmserve.kernels.fp8`'s
definition; none for AWQ, whose activations stay 16-bit): each case equals its greedy tokens or
splits from them at a near-tie (tests/support/reference.py). The agreement with the plain bf16
dequantized model (no activation quantization) over all the cases' tokens is printed (`-s`).

On the CPU the same check runs smaller (two cases, 8 tokens) in float32 with the kernels forced
(`MMSERVE_QUANTIZED_GEMM=kernels`, Triton's interpreter): the engine's path through them, off the GPU.

The checkpoints: the tiny dense Qwen2-VL quantized by `mmserve.tiny.quantized` in blocks of
32 x 32 (Hopper's FP8 `tl.dot` needs a K tile of 32: the tiny builder's 16 x 16 blocks take the
dequantizing path) and AWQ groups of 32.
"""

from __future__ import annotations

import importlib
import os
import queue
import shutil
from pathlib import Path

import pytest
import torch

from llm_service.model import quantized_gemm
from tests.support.cases import family_cases
from tests.support.reference import NearTieTally, greedy_reference, load_reference

CUDA = torch.cuda.is_available()
GPU_RUN = dict(device="cuda", dtype=torch.bfloat16, max_tokens=32,
               cases=("text_only", "one_image", "three_images", "video", "image_and_video", "long_prompt"))
CPU_RUN = dict(device="cpu", dtype=torch.float32, max_tokens=8, cases=("text_only", "one_image"))
KERNELS = {"fp8-block": ("triton_fp8", "block_fp8_linear", 32), "fp8-channel": ("triton_fp8", "channel_fp8_linear", 0),
           "awq": ("triton_w4a16", "awq_gemm", None)}  # module, function, activation group (0: the row)


def _hopper() -> bool:
    return CUDA and torch.cuda.get_device_capability() >= (9, 0)


@pytest.fixture(scope="module")
def gpu_checkpoint(tiny_models, models_root):
    """quantization -> (the tiny Qwen2-VL in it, blocks of 32 x 32 / groups of 32; its dequantized copy)."""
    from mmserve.tiny.quantized import quantize_checkpoint
    from tests.support.quantized_reference import dequantized_copy

    def make(quantization: str) -> tuple[str, str]:
        out = os.path.join(models_root, f"qwen2_vl-{quantization}-gpu")
        if not os.path.isfile(os.path.join(out, "config.json")):
            shutil.rmtree(out + ".tmp", ignore_errors=True)
            shutil.copytree(tiny_models["qwen2_vl"], out + ".tmp")
            quantize_checkpoint(Path(out + ".tmp"), quantization, block=[32, 32], group=32)
            os.replace(out + ".tmp", out)
        return out, dequantized_copy(out, out + "-dequantized")

    return make


def served(model_dir: str, named: dict[str, list[dict]], device: str, dtype: torch.dtype,
           max_tokens: int) -> dict[str, tuple[list[int], bool]]:
    """Each case's greedy tokens from the engine (on CUDA: in its decode graphs) and whether it stopped on EOS."""
    from transformers import AutoTokenizer

    from encoder_service import VisionEncoder
    from llm_service.engine.llm_engine import LLMEngine, LLMRequest
    from llm_service.model.language_model import LanguageModel
    from llm_service.sampling import SamplingParams
    from mmserve.request.prompt_plan import RequestPlanner
    from tests.support.pipeline import collect, to_planner_messages

    planner = RequestPlanner(model_dir, AutoTokenizer.from_pretrained(model_dir))
    name = str(dtype).removeprefix("torch.")
    encoder = VisionEncoder(model_dir, dtype=name, device=device)
    engine = LLMEngine(LanguageModel(model_dir, dtype=name, device=device))
    engine.start()
    out = {}
    try:
        for name, messages in named.items():
            plan = planner.plan(to_planner_messages(messages), ())
            embeddings = encoder.encode(plan.media) if plan.items else []
            events: queue.Queue = queue.Queue()
            engine.add_request(LLMRequest(name, tuple(plan.token_ids), SamplingParams(max_tokens=max_tokens),
                                          positions=plan.positions, media=tuple(zip(plan.ranges, embeddings))),
                               events.put)
            tokens, finish = collect(events)
            out[name] = tokens, finish == "stop"
        assert device != "cuda" or engine.runner.graphs is not None  # decode ran in the CUDA graphs
    finally:
        engine.shutdown()
    return out


def quantize_inputs(model, group: int):
    """Forward pre-hooks on the language model's projections: their input through the per-token
    FP8 quantization (`group` columns a scale; 0: the whole row) and back. Returns the handles."""
    from mmserve.kernels.fp8 import fake_quantize

    def hook(module, args):
        x = args[0]
        return (fake_quantize(x, group or x.shape[-1]),)

    return [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and "language_model" in name and name.endswith("_proj")]


def check_format(quantization: str, model_dir: str, reference_dir: str, monkeypatch, device: str,
                 dtype: torch.dtype, max_tokens: int, cases: tuple[str, ...]) -> None:
    """The engine's tokens with the format's kernel == the same-quantization reference's, or splits at
    near-ties; the agreement with the plain dequantized model printed."""
    module, function, group = KERNELS[quantization]
    kernel = importlib.import_module(f"mmserve.kernels.{module}")
    calls, original = [], getattr(kernel, function)
    monkeypatch.setattr(kernel, function, lambda *a, **k: calls.append(1) or original(*a, **k))
    named = {name: family_cases("qwen2_vl")[name] for name in cases}
    got = served(model_dir, named, device, dtype, max_tokens)
    assert calls  # the kernel ran (eager prefill steps and the graphs' capture)

    _, model = load_reference(reference_dir, dtype, device)
    plain = {name: greedy_reference(reference_dir, messages, max_tokens, dtype, device)
             for name, messages in named.items()}
    handles = quantize_inputs(model, group) if group is not None else []
    try:
        assert group is None or len(handles) == 7 * model.config.get_text_config().num_hidden_layers
        same_quantization = {name: greedy_reference(reference_dir, messages, max_tokens, dtype, device)
                             for name, messages in named.items()}
    finally:
        for handle in handles:
            handle.remove()
    tally = NearTieTally()
    for name, (tokens, stopped) in got.items():
        tally.check(name, tokens, stopped, same_quantization[name])
    agreed = total = 0
    for name, (tokens, _) in got.items():
        want = plain[name].tokens
        total += len(want)
        agreed += next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
    print(f"\n{quantization} ({device}, {dtype}): vs the dequantized model with the same activation quantization: "
          f"{tally.summary(len(got))}; tokens agreeing with the plain dequantized model (up to each first split): "
          f"{agreed}/{total} ({agreed / max(total, 1):.0%})")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("quantization", list(KERNELS))
def test_served_tokens_equal_the_dequantized_model_with_the_same_activation_quantization_or_split_at_near_ties(
        quantization, gpu_checkpoint, monkeypatch):
    if quantization.startswith("fp8") and not _hopper():
        pytest.skip("FP8 tensor cores need compute capability >= 9.0")
    monkeypatch.delenv(quantized_gemm.ENV, raising=False)  # auto: what a replica does
    check_format(quantization, *gpu_checkpoint(quantization), monkeypatch, **GPU_RUN)


@pytest.mark.kernel
@pytest.mark.skipif(CUDA, reason="the CPU's run of the check above (interpreter)")
@pytest.mark.parametrize("quantization", list(KERNELS))
def test_engine_with_the_kernels_forced_on_the_cpu_equals_the_same_quantization_reference(
        quantization, gpu_checkpoint, monkeypatch):
    monkeypatch.setenv(quantized_gemm.ENV, "kernels")
    check_format(quantization, *gpu_checkpoint(quantization), monkeypatch, **CPU_RUN)
