"""LoRA adapters of the vision tower and merger, applied by the encoder: its output equals the
tower of `peft`'s merged model in a batch mixing adapters and the base, the engine + encoder give
`transformers`' tokens on the merged model, and every encoder-side key follows the adapter only
where it changes the tower (float64, the tiny Qwen2-VL-family checkpoints)."""

import asyncio
import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder_service.batching import BatchConfig
from encoder_service.lora import read_tower_adapter
from encoder_service.pool import EncoderPool, PoolConfig
from llm_service.engine.sequence import LoraRequest
from llm_service.model.lora import read_adapter
from mmserve.errors import InvalidRequest
from mmserve.inputs.media import AdapterRef, EncodeItem, MediaItem, MediaKind
from mmserve.lora import targets_tower, tower_media
from mmserve.tiny.lora import VISION_TARGETS, build_tiny_adapter
from tests.support.engine_support import Collector, image_prompt, make_engine, run_until_done
from tests.support.media_factory import image_bytes, video_frames
from tests.support.pipeline import plan_request, runtimes, to_planner_messages
from tests.support.reference import load_merged_reference, load_reference, reference_generate

MAX_TOKENS = 10
EXACT = dict(rtol=0, atol=1e-10)
# "tv": the LM's projections and every tower linear + the merger; "lm": the LM's only; "v": the tower's only
ADAPTERS = {"tv": dict(seed=7, vision_targets=VISION_TARGETS, std=0.1),
            "lm": dict(seed=8, rank=2, targets=("q_proj", "v_proj")),
            "v": dict(seed=9, targets=(), vision_targets=("qkv", "fc2", "down_proj", "merger"), use_rslora=True)}
_BUILT: dict[str, dict[str, AdapterRef]] = {}


@pytest.fixture(scope="module")
def adapters_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tower_adapters")


def _adapters(model_dir: str, root: Path) -> dict[str, AdapterRef]:
    if model_dir not in _BUILT:
        family = Path(model_dir).name
        _BUILT[model_dir] = {name: AdapterRef(name, str(build_tiny_adapter(model_dir, root / family / name, **kw)))
                             for name, kw in ADAPTERS.items()}
    return _BUILT[model_dir]


def _images() -> list[MediaItem]:
    return [MediaItem(MediaKind.IMAGE, (image_bytes(h, w, seed),)) for h, w, seed in ((56, 84, 1), (112, 56, 2))]


def _tower_reference(model, model_dir: str, item: MediaItem) -> torch.Tensor:
    """The merged rows of `item` from the monolithic `model`'s own tower (the processor's pixels)."""
    from tests.support.reference import load_processor

    out = load_processor(model_dir).image_processor(images=[_pil(item)], return_tensors="pt")
    with torch.no_grad():
        pooled = model.model.get_image_features(out["pixel_values"].to(torch.float64),
                                                image_grid_thw=out["image_grid_thw"]).pooler_output
    return torch.cat(pooled) if isinstance(pooled, (tuple, list)) else pooled


def _pil(item: MediaItem):
    from mmserve.inputs.media import decode_image

    return decode_image(item.frames[0])


def test_a_batch_mixing_adapters_and_the_base_equals_peft_merged_towers(model_dir, adapters_root):
    _, encoder, _ = runtimes(model_dir)
    adapters = _adapters(model_dir, adapters_root)
    first, second = _images()
    under = {"tv": adapters["tv"], "v": adapters["v"], None: None}
    items = [dataclasses.replace(first, tower_adapter=under["tv"]), second, first,
             dataclasses.replace(second, tower_adapter=under["v"]), dataclasses.replace(second, tower_adapter=under["tv"])]
    got = [e.rows for e in encoder.encode([encoder.plan(i) for i in items])]
    _, base = load_reference(model_dir)
    for item, rows in zip(items, got):
        ref = item.tower_adapter
        model = base if ref is None else load_merged_reference(model_dir, ref.path)
        expected = _tower_reference(model, model_dir, dataclasses.replace(item, tower_adapter=None))
        assert torch.allclose(rows, expected, **EXACT), ref
    assert not torch.allclose(got[0], got[2], atol=1e-3)  # the adapter matters


def test_pooled_pieces_of_a_video_keep_its_adapter(tiny_models, adapters_root):
    """A video over the budget, split into temporal groups, batched with base items: each piece
    is encoded under the video's adapter."""
    model_dir = tiny_models["qwen2_5_vl"]
    _, encoder, _ = runtimes(model_dir)
    adapter = _adapters(model_dir, adapters_root)["tv"]
    video = MediaItem(MediaKind.VIDEO, tuple(video_frames(8, 56, 56, 3)), fps=2.0, tower_adapter=adapter)
    items = [encoder.plan(i) for i in (video, *_images())]
    alone = [encoder.encode([item])[0].rows for item in items]

    async def pooled():
        pool = EncoderPool(encoder, PoolConfig(BatchConfig(max_batch_tokens=12, batch_wait_ms=20), cache_bytes=0))
        try:
            return [e.rows for e in await pool.encode(items)]
        finally:
            await pool.close()

    got = asyncio.run(pooled())
    assert all(torch.allclose(g, a, **EXACT) for g, a in zip(got, alone))
    base = encoder.encode([encoder.plan(dataclasses.replace(video, tower_adapter=None))])[0].rows
    assert not torch.allclose(got[0], base, atol=1e-3)


def test_engine_and_encoder_under_a_tower_adapter_equal_peft_merged_generate(model_dir, adapters_root):
    """An image prompt under an adapter of the LM and the tower, beside the same prompt under the
    base model in one engine: each gives `transformers`' greedy tokens on its merged model."""
    planner, encoder, _ = runtimes(model_dir)
    adapter = _adapters(model_dir, adapters_root)["tv"]
    prompt = image_prompt(3)
    plan = planner.plan(to_planner_messages(prompt))
    media = tower_media(plan.media, adapter)
    assert all(m.item.tower_adapter == adapter for m in media)
    lora = LoraRequest(adapter.name, adapter.path)
    request = dataclasses.replace(plan_request(model_dir, prompt, "tv", MAX_TOKENS), lora=lora,
                                  media=tuple(zip(plan.ranges, encoder.encode(media))))
    engine = make_engine(model_dir, max_loras=1)
    collector = Collector()
    collector.add(engine, request)
    collector.add(engine, plan_request(model_dir, prompt, "base", MAX_TOKENS))
    run_until_done(engine, collector)
    expected = reference_generate(model_dir, prompt, MAX_TOKENS, adapter=adapter.path)
    assert collector.tokens("tv") == expected
    assert collector.tokens("base") == reference_generate(model_dir, prompt, MAX_TOKENS)
    assert expected != collector.tokens("base")


def test_keys_follow_the_adapter_only_where_it_changes_the_tower(tiny_models, adapters_root):
    """The content hash (the encoder cache's and in-flight dedup's key, the affinity router's and
    the gRPC transport's) of an image under a tower adapter is its own; under an LM-only adapter
    it is the base model's, and the cache serves the base embedding."""
    model_dir = tiny_models["qwen2_vl"]
    _, encoder, _ = runtimes(model_dir)
    adapters = _adapters(model_dir, adapters_root)
    image = [encoder.plan(_images()[0])]
    under = {name: tower_media(image, ref)[0] for name, ref in adapters.items()}
    base = image[0]
    assert not targets_tower(adapters["lm"].path) and targets_tower(adapters["tv"].path)
    assert under["lm"] == base and under["lm"].item.content_hash == base.item.content_hash
    hashes = {base.item.content_hash, under["tv"].item.content_hash, under["v"].item.content_hash}
    assert len(hashes) == 3
    other_path = tower_media(image, AdapterRef("tv", adapters["v"].path))[0]
    assert other_path.item.content_hash not in hashes  # the same name from another directory is another key
    assert encoder.identity.key(under["tv"].item) != encoder.identity.key(base.item)

    async def run():
        pool = EncoderPool(encoder, PoolConfig(BatchConfig(batch_wait_ms=1), cache_bytes=1 << 24))
        try:
            first = await pool.encode([base, under["tv"], base, under["tv"]])  # dedup within each key
            again = await pool.encode([under["lm"], under["tv"]])
            return first, again, pool.stats()
        finally:
            await pool.close()

    first, again, stats = asyncio.run(run())
    assert (stats.cache_misses, stats.dedup_hits, stats.cache_hits) == (2, 2, 2)
    assert not torch.allclose(first[0].rows, first[1].rows, atol=1e-3)
    assert torch.equal(again[0].rows, first[0].rows) and torch.equal(again[1].rows, first[1].rows)


def test_the_lm_reads_the_lm_modules_of_a_tower_adapter_and_leaves_the_tower_s(tiny_models, adapters_root):
    model_dir = tiny_models["qwen2_vl"]
    adapters = _adapters(model_dir, adapters_root)
    engine = make_engine(model_dir, max_loras=2)
    args = (engine.runner.loras.linears, engine.model.face.rename, torch.float64, torch.device("cpu"))
    both = read_adapter(LoraRequest("tv", adapters["tv"].path), *args)
    assert both.deltas and all(k.startswith("layers.") for k in both.deltas)
    assert read_adapter(LoraRequest("v", adapters["v"].path), *args).deltas == {}
    _, encoder, _ = runtimes(model_dir)
    tower = read_tower_adapter(adapters["tv"], encoder.tower, encoder.face.rename, encoder.face.lora_stages,
                               torch.float64, torch.device("cpu"))
    assert len(tower.deltas) == 2 * 4 + 2  # 2 blocks x qkv, proj, fc1, fc2; the merger's 2 linears
    assert read_tower_adapter(adapters["lm"], encoder.tower, encoder.face.rename, encoder.face.lora_stages,
                              torch.float64, torch.device("cpu")).deltas == {}


_VISUAL = "base_model.model.model.visual."


def _edited(adapter: AdapterRef, root: Path, edit) -> AdapterRef:
    path = root / "bad"
    shutil.copytree(adapter.path, path)
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, path / "adapter_model.safetensors")
    return AdapterRef("bad", str(path))


BAD = {
    "rank": (lambda t: t.update({_VISUAL + "blocks.1.attn.qkv.lora_A.weight": torch.zeros(3, 32)}),
             "blocks.1.attn.qkv lora_A (3, 32)"),
    "output size": (lambda t: t.update({_VISUAL + "merger.mlp.2.lora_B.weight": torch.zeros(5, 4)}),
                    "merger.mlp.2 lora_A"),
    "a module the tower lacks": (lambda t: t.update({_VISUAL + "blocks.7.attn.qkv.lora_A.weight": torch.zeros(4, 32),
                                                     _VISUAL + "blocks.7.attn.qkv.lora_B.weight": torch.zeros(96, 4)}),
                                 "visual.blocks.7.attn.qkv: the vision tower has no such module"),
    "not a linear": (lambda t: t.update({_VISUAL + "patch_embed.proj.lora_A.weight": torch.zeros(4, 32),
                                         _VISUAL + "patch_embed.proj.lora_B.weight": torch.zeros(32, 4)}),
                     "patch_embed.proj: the vision tower has it as a Conv3d"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_tower_adapter_that_does_not_fit_is_refused_naming_it_and_the_field(tiny_models, adapters_root, tmp_path,
                                                                               case):
    model_dir = tiny_models["qwen2_vl"]
    _, encoder, _ = runtimes(model_dir)
    edit, message = BAD[case]
    bad = _edited(_adapters(model_dir, adapters_root)["tv"], tmp_path, edit)
    item = encoder.plan(dataclasses.replace(_images()[0], tower_adapter=bad))
    with pytest.raises(InvalidRequest, match="adapter 'bad'") as refused:
        encoder.encode([item])
    assert message in str(refused.value)
    assert encoder.encode([encoder.plan(_images()[0])])  # the encoder goes on



def test_a_standalone_encoder_refuses_an_item_under_a_tower_adapter():
    from deployments.core.dispatch import ExternalEncoderDispatcher

    item = EncodeItem(dataclasses.replace(_images()[0], tower_adapter=AdapterRef("v", "/adapters/v")), None, 1)
    with pytest.raises(InvalidRequest, match="adapter 'v' targets the vision tower"):
        asyncio.run(ExternalEncoderDispatcher("localhost:1").dispatch([item]))


def test_the_cli_writes_a_tower_only_adapter(tiny_models, tmp_path, capsys):
    from deployments.cli.main import main

    out = tmp_path / "tower"
    assert main(["build-tiny-adapter", "--model", tiny_models["qwen2_vl"], "--out", str(out), "--targets", "",
                 "--vision-targets", "qkv,merger"]) == 0
    keys = sorted(load_file(out / "adapter_model.safetensors"))
    modules = sorted({k.removeprefix(_VISUAL).rpartition(".lora_")[0] for k in keys})
    assert modules == ["blocks.0.attn.qkv", "blocks.1.attn.qkv", "merger.mlp.0", "merger.mlp.2"]
    assert targets_tower(out)
