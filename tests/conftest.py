import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels (tests marked `kernel`) run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ("tests.support.serve_fixtures",)

FAMILIES = ("qwen2_vl", "qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Both tiny checkpoints, built once per session (reused across runs via MMSERVE_TEST_MODELS)."""
    from mmserve.tiny import ensure_tiny_model

    root = os.environ.get("MMSERVE_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))
    return {f: str(ensure_tiny_model(f, os.path.join(root, f))) for f in FAMILIES}


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def model_dir(tiny_models, family) -> str:
    return tiny_models[family]


@pytest.fixture(scope="session")
def llava_models(tmp_path_factory) -> dict[str, str]:
    """Both tiny LLaVA checkpoints (`llava`: CLIP + Llama, `llava_siglip`: SigLIP + Qwen2)."""
    from mmserve.tiny import LLAVA_FAMILIES, ensure_tiny_model

    root = os.environ.get("MMSERVE_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))
    return {f: str(ensure_tiny_model(f, os.path.join(root, f))) for f in LLAVA_FAMILIES}


@pytest.fixture(scope="session")
def minicpmv_dir(tmp_path_factory) -> str:
    """The tiny MiniCPM-V 4.6 checkpoint (hybrid Gated-DeltaNet LM, slices, structure tokens)."""
    from mmserve.tiny import ensure_tiny_model

    root = os.environ.get("MMSERVE_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))
    return str(ensure_tiny_model("minicpmv4_6", os.path.join(root, "minicpmv4_6")))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    """The tiny Qwen3-VL checkpoint (DeepStack, interleaved M-RoPE, video timestamps)."""
    from mmserve.tiny import ensure_tiny_model

    root = os.environ.get("MMSERVE_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))
    return str(ensure_tiny_model("qwen3_vl", os.path.join(root, "qwen3_vl")))
