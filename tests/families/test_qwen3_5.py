"""Qwen3.5 and Qwen3.5-MoE: the tiny checkpoints have the published structure and load with the
stock Auto classes, their greedy tokens depend on the images, the encoder face equals the class's
own image features, a repeated long prompt on the MoE model resumes from its state snapshots
(fewer prompt tokens computed, same tokens as `generate`), and per-expert checkpoints load."""

from __future__ import annotations

import pytest
import torch

from llm_service.model import experts
from mmserve.tiny.qwen3_5 import QWEN3_5_CHAT_TEMPLATE
from tests.support.cases import LONG_TEXT, image, image_question, text, user
from tests.support.engine_support import Collector, language_model, make_engine, plan_request, run_until_done
from tests.support.reference import load_reference, reference_generate

QWEN3_5_FAMILIES = ("qwen3_5", "qwen3_5_moe")


@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_loads_with_auto_classes_in_the_published_shape(tiny_checkpoint, family):
    from transformers import AutoProcessor

    model_dir = tiny_checkpoint(family)
    processor, model = load_reference(model_dir)
    assert type(AutoProcessor.from_pretrained(model_dir)).__name__ == "Qwen3VLProcessor"
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    assert processor.chat_template == QWEN3_5_CHAT_TEMPLATE
    text_config = model.config.text_config
    assert text_config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert text_config.rope_parameters["mrope_interleaved"] and text_config.rope_parameters["partial_rotary_factor"] < 1
    assert not hasattr(model.model.visual, "deepstack_merger_list")
    if family == "qwen3_5_moe":
        mlp = model.model.language_model.layers[0].mlp
        assert mlp.experts.gate_up_proj.shape[0] == text_config.num_experts > text_config.num_experts_per_tok
        assert mlp.shared_expert is not None and mlp.shared_expert_gate is not None
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi \n"}]}]
    assert processor.apply_chat_template(chat, add_generation_prompt=True) == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert processor.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _zeroed(model_dir, module, prompt) -> list[int]:
    hook = module.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    try:
        return reference_generate(model_dir, prompt, 12)
    finally:
        hook.remove()


@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_greedy_tokens_depend_on_the_images_and_their_embeddings(tiny_checkpoint, family):
    model_dir = tiny_checkpoint(family)
    prompt = image_question(image(64, 96, 1))
    one = reference_generate(model_dir, prompt, 12)
    two = reference_generate(model_dir, image_question(image(64, 96, 1), image(80, 50, 2)), 12)
    assert len(one) == len(two) == 12 and one != two
    _, model = load_reference(model_dir)
    assert _zeroed(model_dir, model.model.visual.merger, prompt) != one


@pytest.mark.parametrize("family", QWEN3_5_FAMILIES)
def test_encoder_face_equals_the_class_image_features(tiny_checkpoint, family):
    from encoder_service import VisionEncoder
    from mmserve.inputs.media import MediaItem, MediaKind
    from tests.support.reference import reference_inputs

    model_dir = tiny_checkpoint(family)
    messages = image_question(image(64, 96, 1), image(120, 40, 3))
    inputs = reference_inputs(model_dir, messages)
    _, model = load_reference(model_dir)
    with torch.no_grad():
        expected = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    encoder = VisionEncoder(model_dir, dtype="float64")
    items = [MediaItem(MediaKind.IMAGE, (p["bytes"],)) for p in messages[0]["content"] if p["type"] == "image"]
    got = encoder.encode(items)
    assert all(len(e.parts) == 1 for e in got)  # no DeepStack part
    torch.testing.assert_close(torch.cat([e.parts[0] for e in got]), torch.cat(expected), rtol=1e-9, atol=1e-9)


def test_a_repeated_long_prompt_resumes_from_its_snapshots_with_the_moe_layers(tiny_checkpoint):
    """The second request's prefill starts at the deepest state snapshot of its prompt (the last
    block boundary before its final token): its experts see only the rest of the prompt."""
    model_dir = tiny_checkpoint("qwen3_5_moe")
    engine = make_engine(model_dir, block_size=8)
    assert engine.config.enable_prefix_caching and engine.scheduler.snapshots is not None
    messages = user(image(64, 64, 8), text(LONG_TEXT))
    prompt = len(plan_request(model_dir, messages, "x", 1).prompt_token_ids)
    expected = reference_generate(model_dir, messages, 6)
    load, routed = engine.runner.expert_load, []
    for n in range(2):
        collector = Collector()
        collector.add(engine, plan_request(model_dir, messages, f"r{n}", 6))
        run_until_done(engine, collector)
        assert collector.tokens(f"r{n}") == expected
        load.collect(engine.runner.num_forwards, force=True)
        counts, _ = load.drain()
        routed.append(int(counts[0].sum()) // engine.model.text_config.num_experts_per_tok)  # tokens through layer 0
    stats = engine.stats()
    resumed = (prompt - 1) // 8 * 8
    assert stats.num_cached_tokens == resumed and stats.num_snapshot_resumes == 1
    assert routed == [prompt + 5, prompt - resumed + 5]  # the prompt computed, then 5 decode steps


def test_per_expert_checkpoints_load_as_the_stacked_experts(tiny_checkpoint, tmp_path):
    """One tensor per expert (`mlp.experts.<j>.gate_proj.weight`, ...), as `transformers` also
    reads Qwen3.5-MoE, loads into the same experts as the stacked layout."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tiny_checkpoint("qwen3_5_moe")
    split = tmp_path / "per_expert"
    shutil.copytree(model_dir, split)
    tensors, out = load_file(split / "model.safetensors"), {}
    for key, t in tensors.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for j in range(t.shape[0]):
                out[key.replace("gate_up_proj", f"{j}.gate_proj.weight")] = gate[j].contiguous()
                out[key.replace("gate_up_proj", f"{j}.up_proj.weight")] = up[j].contiguous()
        elif key.endswith("mlp.experts.down_proj"):
            for j in range(t.shape[0]):
                out[key.replace("down_proj", f"{j}.down_proj.weight")] = t[j].contiguous()
        else:
            out[key] = t
    save_file(out, split / "model.safetensors", metadata={"format": "pt"})
    ours, theirs = language_model(model_dir).modules, language_model(str(split)).modules
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert torch.equal(a, b), name
    assert sum(experts.is_experts(m) for m in theirs.decoder.modules()) == 4
