"""LoRA adapters in the engine: token-exact against `peft`'s merged model, several adapters and
the base model in one step, the prefix cache keyed by adapter, LRU of `max_loras`, bad adapters
refused at load (float64, the tiny Qwen2-VL-family checkpoints)."""

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deployments.cli.main import main
from llm_service.engine.sequence import LoraRequest
from llm_service.model.lora import AdapterError, read_adapter, scaling
from mmserve.errors import InvalidRequest
from mmserve.tiny.lora import build_tiny_adapter
from tests.support.cases import text, user
from tests.support.engine_support import Collector, image_prompt, make_engine, plan_request, run_until_done
from tests.support.reference import reference_generate

MAX_TOKENS = 10
PROMPTS = {"text": user(text("Tell me a story about a cat.")), "image": image_prompt(1)}
# "a": every LM projection; "b": a smaller rank, rsLoRA, q and v (slices of qkv_proj, k left alone) and down_proj
ADAPTERS = {"a": dict(seed=1), "b": dict(seed=2, rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"),
                                         use_rslora=True, std=0.1)}
_BUILT: dict[str, dict[str, LoraRequest]] = {}


@pytest.fixture(scope="module")
def adapters_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters")


def _adapters(model_dir: str, root: Path) -> dict[str, LoraRequest]:
    """The test adapters of `model_dir`, built once."""
    if model_dir not in _BUILT:
        family = Path(model_dir).name
        _BUILT[model_dir] = {name: LoraRequest(name, str(build_tiny_adapter(model_dir, root / family / name, **kw)))
                             for name, kw in ADAPTERS.items()}
    return _BUILT[model_dir]


def _request(model_dir: str, messages, request_id: str, lora: LoraRequest | None, max_tokens: int = MAX_TOKENS):
    return dataclasses.replace(plan_request(model_dir, messages, request_id, max_tokens), lora=lora)


def _expected(model_dir: str, case: str, lora: LoraRequest | None) -> list[int]:
    return reference_generate(model_dir, PROMPTS[case], MAX_TOKENS, adapter=lora and lora.path)


def test_two_adapters_and_the_base_in_one_batch_equal_peft_merged(model_dir, adapters_root):
    adapters = _adapters(model_dir, adapters_root)
    engine = make_engine(model_dir, max_loras=2)
    steps = []
    run = engine.runner.run
    engine.runner.run = lambda step: steps.append(({n for n, _ in step.lora}, len(step.scheduled))) or run(step)
    collector = Collector()
    for case, messages in PROMPTS.items():
        for lora in (None, *adapters.values()):
            collector.add(engine, _request(model_dir, messages, f"{case}-{lora and lora.name}", lora))
    run_until_done(engine, collector)
    assert steps[0] == ({"a", "b"}, 6)  # both adapters and the base model in the first forward
    for case in PROMPTS:
        outputs = {}
        for lora in (None, *adapters.values()):
            name = lora and lora.name
            outputs[name] = collector.tokens(f"{case}-{name}")
            assert outputs[name] == _expected(model_dir, case, lora), (case, name)
        assert outputs["a"] != outputs[None] and outputs["b"] != outputs[None], case  # the adapters matter
    assert not any(engine.runner.loras.holders.values())  # every request let its adapter go


def test_chunked_prefills_and_overlapped_steps_keep_each_adapter_on_its_tokens(tiny_models, adapters_root):
    model_dir = tiny_models["qwen2_vl"]
    adapters = _adapters(model_dir, adapters_root)
    engine = make_engine(model_dir, max_loras=2, max_num_batched_tokens=32, async_scheduling=True)
    collector = Collector()
    for case, messages in PROMPTS.items():
        for lora in (None, *adapters.values()):
            collector.add(engine, _request(model_dir, messages, f"{case}-{lora and lora.name}", lora))
    run_until_done(engine, collector)
    for case in PROMPTS:
        for lora in (None, *adapters.values()):
            assert collector.tokens(f"{case}-{lora and lora.name}") == _expected(model_dir, case, lora), case


def test_the_same_prompt_under_two_adapters_shares_no_cached_block(tiny_models, adapters_root):
    model_dir = tiny_models["qwen2_vl"]
    adapters = _adapters(model_dir, adapters_root)
    engine = make_engine(model_dir, max_loras=2, block_size=8)
    prompt_len = len(plan_request(model_dir, PROMPTS["image"], "x", 1).prompt_token_ids)

    def run(request_id: str, lora: LoraRequest | None) -> tuple[list[int], int]:
        before = engine.stats().num_cached_tokens
        collector = Collector()
        collector.add(engine, _request(model_dir, PROMPTS["image"], request_id, lora))
        run_until_done(engine, collector)
        return collector.tokens(request_id), engine.stats().num_cached_tokens - before

    under = {"a": adapters["a"], "b": adapters["b"], None: None}
    first = {name: run(f"first-{name}", lora) for name, lora in under.items()}
    assert [cached for _, cached in first.values()] == [0, 0, 0]
    for name, lora in (("a", adapters["a"]), (None, None)):
        tokens, cached = run(f"again-{name}", lora)
        assert cached == (prompt_len - 1) // 8 * 8 and tokens == first[name][0]
    assert first["a"][0] == _expected(model_dir, "image", adapters["a"])


def test_at_most_max_loras_are_loaded_and_a_request_waits_for_a_place(tiny_models, adapters_root):
    model_dir = tiny_models["qwen2_vl"]
    adapters = _adapters(model_dir, adapters_root)
    engine = make_engine(model_dir, max_loras=1)
    in_step = []
    run = engine.runner.run
    engine.runner.run = lambda step: in_step.append({n for n, _ in step.lora}) or run(step)
    collector = Collector()
    for name, lora in adapters.items():
        collector.add(engine, _request(model_dir, PROMPTS["text"], name, lora))
    run_until_done(engine, collector)
    assert in_step[0] == {"a"} and in_step[-1] == {"b"} and all(len(s) == 1 for s in in_step)
    assert list(engine.runner.loras.loaded) == ["b"]  # "a" dropped (least recently used, no holder)
    for name, lora in adapters.items():
        assert collector.tokens(name) == _expected(model_dir, "text", lora), name


def test_an_adapter_read_ahead_in_another_thread_is_installed_not_read_again(tiny_models, adapters_root, monkeypatch):
    """Serve's multiplexed loader reads a missing adapter off the engine thread (`prepare_lora`):
    admission then only installs it; `forget_lora` drops one never installed."""
    import threading

    from llm_service.model import lora as lora_module

    model_dir = tiny_models["qwen2_vl"]
    adapters = _adapters(model_dir, adapters_root)
    engine = make_engine(model_dir, max_loras=2)
    reader = threading.Thread(target=lambda: [engine.prepare_lora(a) for a in adapters.values()])
    reader.start()
    reader.join()
    engine.forget_lora("b")
    assert set(engine.runner.loras.ready) == {"a"}
    reads = []
    monkeypatch.setattr(lora_module, "read_adapter", lambda request, *a: reads.append(request.name) or read_adapter(
        request, *a))
    collector = Collector()
    for name, lora in adapters.items():
        collector.add(engine, _request(model_dir, PROMPTS["text"], name, lora))
    run_until_done(engine, collector)
    assert reads == ["b"] and not engine.runner.loras.ready  # "a" was installed as read ahead
    for name, lora in adapters.items():
        assert collector.tokens(name) == _expected(model_dir, "text", lora), name


@pytest.mark.parametrize("quantization", ["fp8-block", "awq"])
def test_an_adapter_on_a_quantized_base_equals_peft_merged_on_the_dequantized_model(tiny_models, adapters_root,
                                                                                    quantized_checkpoint, quantization):
    """The deltas add to the quantized `Linear`'s output (its slices of qkv / gate_up as stored):
    the same tokens as `peft` merging the adapter into the checkpoint dequantized."""
    model_dir, reference_dir = quantized_checkpoint("qwen2_vl", quantization)
    adapter = _adapters(tiny_models["qwen2_vl"], adapters_root)["b"]
    engine = make_engine(model_dir, max_loras=1)
    collector = Collector()
    for lora in (adapter, None):
        collector.add(engine, _request(model_dir, PROMPTS["image"], f"q-{lora and lora.name}", lora))
    run_until_done(engine, collector)
    expected = reference_generate(reference_dir, PROMPTS["image"], MAX_TOKENS, adapter=adapter.path)
    assert collector.tokens("q-b") == expected != reference_generate(reference_dir, PROMPTS["image"], MAX_TOKENS)
    assert collector.tokens("q-None") == reference_generate(reference_dir, PROMPTS["image"], MAX_TOKENS)


def _copy(lora: LoraRequest, root: Path, name: str = "bad") -> Path:
    path = root / name
    shutil.copytree(lora.path, path)
    return path


def _edit_config(path: Path, **fields) -> None:
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, **fields}))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, path / "adapter_model.safetensors")


_PREFIX = "base_model.model.model.language_model.layers.0."
BAD = {
    "rank": (lambda p: _edit_config(p, r=3), "r 3"),
    "target": (lambda p: _edit_config(p, target_modules=["q_proj", "lm_head"]), "target_modules ['lm_head']"),
    "missing file": (lambda p: (p / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors"),
    "missing config": (lambda p: (p / "adapter_config.json").unlink(), "no adapter_config.json"),
    "dora": (lambda p: _edit_config(p, use_dora=True), "use_dora"),
    "input size": (lambda p: _edit_tensors(p, lambda t: t.update({
        _PREFIX + "mlp.down_proj.lora_A.weight": torch.zeros(4, 7)})), "mlp.down_proj lora_A (4, 7)"),
    "module of neither side": (lambda p: _edit_tensors(p, lambda t: t.update({
        "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 8), "base_model.model.lm_head.lora_B.weight":
        torch.zeros(8, 4)})), "target lm_head is neither a language-model nor a vision-tower module"),
    "module the engine lacks": (lambda p: _edit_tensors(p, lambda t: t.update({
        "base_model.model.model.language_model.layers.9.mlp.down_proj.lora_A.weight": torch.zeros(4, 8)})),
        "has no layers.9.mlp.down_proj"),
    "B missing": (lambda p: _edit_tensors(p, lambda t: t.pop(_PREFIX + "self_attn.q_proj.lora_B.weight")),
                  "self_attn.q_proj has no lora_B"),
}


@pytest.mark.parametrize("case", BAD)
def test_an_adapter_that_does_not_fit_is_refused_naming_it_and_the_field(tiny_models, adapters_root, tmp_path, case):
    model_dir = tiny_models["qwen2_vl"]
    path = _copy(_adapters(model_dir, adapters_root)["a"], tmp_path)
    edit, message = BAD[case]
    edit(path)
    engine = make_engine(model_dir, max_loras=1)
    with pytest.raises(AdapterError, match="adapter 'bad'") as refused:
        read_adapter(LoraRequest("bad", str(path)), engine.runner.loras.linears, engine.model.face.rename,
                     torch.float64, torch.device("cpu"))
    assert message in str(refused.value)


def test_a_bad_adapter_fails_its_request_only(tiny_models, adapters_root, tmp_path):
    model_dir = tiny_models["qwen2_vl"]
    path = _copy(_adapters(model_dir, adapters_root)["a"], tmp_path)
    _edit_config(path, r=2)
    engine = make_engine(model_dir, max_loras=1)
    collector = Collector()
    collector.add(engine, _request(model_dir, PROMPTS["text"], "bad", LoraRequest("bad", str(path))))
    collector.add(engine, _request(model_dir, PROMPTS["text"], "base", None))
    run_until_done(engine, collector)
    error = collector.events["bad"][-1].error
    assert isinstance(error, InvalidRequest) and "adapter 'bad'" in str(error) and "r 2" in str(error)
    assert collector.tokens("base") == _expected(model_dir, "text", None)
    assert not engine.runner.loras.loaded


def test_a_name_loaded_from_another_path_is_refused(tiny_models, adapters_root, tmp_path):
    model_dir = tiny_models["qwen2_vl"]
    adapter = _adapters(model_dir, adapters_root)["a"]
    engine = make_engine(model_dir, max_loras=2)
    assert engine.runner.loras.hold(adapter)
    with pytest.raises(AdapterError, match="adapter 'a' is loaded from"):
        engine.runner.loras.hold(LoraRequest("a", str(_copy(adapter, tmp_path))))


def test_an_engine_without_max_loras_refuses_an_adapter(tiny_models, adapters_root):
    model_dir = tiny_models["qwen2_vl"]
    engine = make_engine(model_dir)
    collector = Collector()
    collector.add(engine, _request(model_dir, PROMPTS["text"], "r", _adapters(model_dir, adapters_root)["a"]))
    run_until_done(engine, collector)
    assert "max_loras is 0" in str(collector.events["r"][-1].error)


def test_scaling_is_peft_s():
    assert scaling({"r": 4, "lora_alpha": 8}) == 2.0
    assert scaling({"r": 4, "lora_alpha": 8, "use_rslora": True}) == 4.0


def _digest(path: Path) -> str:
    return hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_the_cli_builds_the_same_adapter_and_another_seed_another(tiny_models, adapters_root, tmp_path, capsys):
    model_dir = tiny_models["qwen2_vl"]
    built = Path(_adapters(model_dir, adapters_root)["a"].path)
    assert main(["build-tiny-adapter", "--model", model_dir, "--out", str(tmp_path / "again"), "--seed", "1"]) == 0
    assert str(tmp_path / "again") in capsys.readouterr().out
    assert _digest(tmp_path / "again") == _digest(built)
    assert _digest(build_tiny_adapter(model_dir, tmp_path / "other", seed=3)) != _digest(built)
    keys = load_file(built / "adapter_model.safetensors")
    assert len(keys) == 2 * 7 * 2 and all(".language_model." in k for k in keys)  # 2 layers x 7 projections x A, B


def test_the_router_core_sends_the_adapter_a_request_names_and_lists_each_adapter(tiny_models, adapters_root):
    """`lora_modules`: a request whose `model` names an adapter reaches the LLM with it (its prefix
    hashes their own chain), any other name is a 400 listing the served ones, and `GET /v1/models`
    lists each adapter with the served model as its parent."""
    import asyncio

    from deployments.core.generation import GenerationOptions
    from deployments.core.request_core import ChatRequest
    from mmserve.request.prompt import Message
    from tests.support.core_fakes import FakeLLM, make_core, reader

    model_dir = tiny_models["qwen2_vl"]
    adapter = _adapters(model_dir, adapters_root)["a"]
    llm = FakeLLM()
    core = make_core(model_dir, llm, lora_modules={"a": adapter.path})
    prompt = (Message("user", ("Tell me a story about a cat, a long one please, with a dog in it too.",)),)

    async def send(model: str):
        gen = await core.generate(None, reader(ChatRequest(prompt, GenerationOptions(max_tokens=2), model=model)),
                                  f"r-{model}")
        async for _ in gen.deltas():
            pass

    asyncio.run(send("a"))
    asyncio.run(send("m"))
    (under, base) = llm.calls
    assert under.lora == LoraRequest("a", adapter.path) and base.lora is None
    assert under.prompt_token_ids == base.prompt_token_ids and under.prefix_hashes
    assert not set(under.prefix_hashes) & set(base.prefix_hashes)
    with pytest.raises(InvalidRequest, match="model 'b' is not served here; use 'm', 'a'"):
        asyncio.run(send("b"))
    cards = core.model_cards()
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [("m", None, model_dir), ("a", "m", adapter.path)]


def test_lora_modules_are_checked_at_start(tiny_models, tmp_path):
    from deployments.config import AppArgs

    with pytest.raises(ValueError, match=r"lora_modules\.x: .* holds no adapter_config.json"):
        AppArgs(model=tiny_models["qwen2_vl"], lora_modules={"x": str(tmp_path)}).on_node()
    with pytest.raises(ValueError, match="cannot name an adapter"):
        AppArgs(served_model_name="m", lora_modules={"m": str(tmp_path)})
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        AppArgs(lora_modules={"x": str(tmp_path)}, engine={"tensor_parallel_size": 2})



def test_mmserve_serve_takes_adapters_as_name_equals_dir(tmp_path):
    import argparse

    from deployments.cli.local_serve import app_args
    from deployments.cli.main import _lora_module

    assert _lora_module("support=/adapters/s=1") == ("support", "/adapters/s=1")
    with pytest.raises(argparse.ArgumentTypeError, match="is not NAME=DIR"):
        _lora_module("support")
    flags = dict(model=None, dtype="auto", device="auto", num_cpus=2, encoder_gpus=0, llm_gpus=0, max_model_len=None,
                 tensor_parallel_size=1, lora=[("a", str(tmp_path / "a")), ("b", str(tmp_path / "b"))])
    assert app_args(argparse.Namespace(**flags), None).lora_modules == {"a": str(tmp_path / "a"),
                                                                         "b": str(tmp_path / "b")}
