import os

import pytest
import torch
from hypothesis import settings

if not torch.cuda.is_available():  # Triton kernels (tests marked `kernel`) run in the interpreter on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest_plugins = ("tests.support.serve_fixtures",)

# Under CI every property test runs its own fixed budget (`max_examples` in its `@settings`) of the
# same derandomized examples each run: a run's time and outcome do not depend on luck (docs/testing.md).
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# the session's one Ray + Serve instance and what is deployed on it (tests/support/serve_fixtures.py)
SESSION_SERVE = {"serve_ports", "serve_urls", "grpc_target", "secured_url", "external_encoder_url"}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects
def pytest_collection_modifyitems(config, items):
    """A test on the session's Ray and Serve instance is marked `serve` whatever its module says, and
    those run first, while its apps stand (docs/testing.md); each group keeps its order."""
    for item in items:
        if SESSION_SERVE & set(item.fixturenames):
            item.add_marker(pytest.mark.serve)
    items.sort(key=lambda item: not (SESSION_SERVE & set(item.fixturenames)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test on the session's instance (they run first) and its module's fixtures, the
    instance stops: the tests after it start a Ray of their own."""
    yield
    if (nextitem is not None and item.parent is not nextitem.parent and SESSION_SERVE & set(item.fixturenames)
            and not SESSION_SERVE & set(nextitem.fixturenames)):
        from tests.support.serve_fixtures import end_session_cluster

        end_session_cluster()


@pytest.fixture(scope="session", autouse=True)
def no_ray_unless_marked_serve():
    """`scripts/test` runs the tests not marked `serve` beside those that are, with MMSERVE_TEST_NO_RAY
    set: none of them may start a Ray of its own (docs/testing.md)."""
    if os.environ.get("MMSERVE_TEST_NO_RAY"):
        import ray

        def refuse(*args, **kwargs):
            raise RuntimeError("this test starts Ray: mark it `serve` (docs/testing.md)")

        ray.init = refuse


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> str:
    """Where the test checkpoints are built: $MMSERVE_TEST_MODELS (reused across runs), else a temporary folder."""
    return os.environ.get("MMSERVE_TEST_MODELS") or str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_checkpoint(models_root):
    """family -> the directory of its tiny checkpoint (`mmserve.tiny.FAMILIES`), built on first use."""
    from mmserve.tiny import ensure_tiny_model

    return lambda family: str(ensure_tiny_model(family, os.path.join(models_root, family)))


@pytest.fixture(scope="session")
def quantized_checkpoint(models_root):
    """(family, quantization) -> (its tiny checkpoint in that format, `mmserve.tiny.quantized`; that
    checkpoint dequantized in float64, `tests.support.quantized_reference`), built on first use."""
    from mmserve.tiny import build_tiny_model
    from tests.support.quantized_reference import dequantized_copy

    def make(family, quantization):
        out = os.path.join(models_root, f"{family}-{quantization}")
        if not os.path.isfile(os.path.join(out, "mmserve_tiny.json")):
            build_tiny_model(family, out, quantization=quantization)
        return out, dequantized_copy(out, out + "-dequantized")

    return make


@pytest.fixture(scope="session")
def tiny_models(tiny_checkpoint) -> dict[str, str]:
    """Both tiny Qwen2-VL-family checkpoints."""
    return {f: tiny_checkpoint(f) for f in FAMILIES}


# the session's apps serve two adapters per family (tests/serve/test_lora_serve.py): one on every LM
# projection; one of rank 2 with rsLoRA on q, v (slices of qkv_proj), down_proj and the vision tower's
# attention and merger (the Encoder applies that part)
TINY_ADAPTERS = {"tiny-lora": dict(seed=1),
                 "tiny-lora-b": dict(seed=2, rank=2, alpha=4.0, use_rslora=True, targets=("q_proj", "v_proj", "down_proj"),
                                     vision_targets=("qkv", "proj", "merger"), std=0.1)}


@pytest.fixture(scope="session")
def tiny_loras(tiny_models, models_root) -> dict[str, dict[str, str]]:
    """family -> {adapter name: its PEFT directory} (`TINY_ADAPTERS`), built on first use."""
    from mmserve.tiny.lora import build_tiny_adapter

    out = {}
    for family in FAMILIES:
        for name, kw in TINY_ADAPTERS.items():
            path = os.path.join(models_root, f"{family}-{name}")
            if not os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
                build_tiny_adapter(tiny_models[family], path, **kw)
            out.setdefault(family, {})[name] = path
    return out


@pytest.fixture(scope="session")
def tiny_lora(tiny_loras) -> str:
    """The tiny Qwen2-VL's first adapter, served as `TINY_LORA` by the session's qwen2_vl app."""
    return tiny_loras["qwen2_vl"]["tiny-lora"]


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def model_dir(tiny_models, family) -> str:
    return tiny_models[family]


@pytest.fixture(scope="session")
def llava_models(tiny_checkpoint) -> dict[str, str]:
    """Both tiny LLaVA checkpoints (`llava`: CLIP + Llama, `llava_siglip`: SigLIP + Qwen2)."""
    from mmserve.tiny import LLAVA_FAMILIES

    return {f: tiny_checkpoint(f) for f in LLAVA_FAMILIES}


@pytest.fixture(scope="session")
def minicpmv_dir(tiny_checkpoint) -> str:
    """The tiny MiniCPM-V 4.6 checkpoint (hybrid Gated-DeltaNet LM, slices, structure tokens)."""
    return tiny_checkpoint("minicpmv4_6")


@pytest.fixture(scope="session")
def qwen3_dir(tiny_checkpoint) -> str:
    """The tiny Qwen3-VL checkpoint (DeepStack, interleaved M-RoPE, video timestamps)."""
    return tiny_checkpoint("qwen3_vl")


@pytest.fixture(scope="session")
def step3_dir(tiny_checkpoint) -> str:
    """The tiny Step3 checkpoint (`step3p7`: crops and a global view, sliding + full layers, MoE)."""
    return tiny_checkpoint("step3p7")
