"""Qwen3-VL served disaggregated == `transformers` monolithic `generate` (float64), through the
runtimes: chunked prefill splitting an image, batched requests with DeepStack (every case:
tests/families/test_equivalence_runtime.py); the DeepStack parts are used; the router's prompt
(video timestamps) and positions equal the processor's and `get_rope_index`'s."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.errors import InvalidRequest
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import MediaItem, MediaKind
from tests.support.cases import CASE_TOKENS, LONG_TEXT, family_cases, image, text, user, video
from tests.support.engine_support import Collector, make_engine, run_until_done
from tests.support.media_factory import video_frames
from tests.support.pipeline import plan_request, runtimes, to_planner_messages
from tests.support.reference import load_reference, reference_generate, reference_inputs

MAX_TOKENS = CASE_TOKENS["qwen3_vl"]


def _case(name: str) -> list[dict]:
    return family_cases("qwen3_vl")[name]


def test_long_prompt_is_long(qwen3_dir):
    processor, _ = load_reference(qwen3_dir)
    assert len(processor.tokenizer(LONG_TEXT)["input_ids"]) > 1000


def test_encoder_parts_are_embeddings_and_deepstack_features(qwen3_dir):
    """Parts == the monolithic model's own `get_image_features` (pooler output, DeepStack list)."""
    messages = _case("one_image")
    planner, encoder, _ = runtimes(qwen3_dir)
    [emb] = encoder.encode(planner.plan(to_planner_messages(messages)).media)
    _, model = load_reference(qwen3_dir)
    inputs = reference_inputs(qwen3_dir, messages)
    with torch.inference_mode():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
    expected = (out.pooler_output[0], *(f[0] for f in out.deepstack_features))
    assert len(emb.parts) == 1 + len(model.config.vision_config.deepstack_visual_indexes) > 1
    for got, ref in zip(emb.parts, expected, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def _engine_tokens(model_dir, requests, **config) -> tuple[dict[str, list[int]], int]:
    engine = make_engine(model_dir, **config)
    collector = Collector()
    for r in requests:
        collector.add(engine, r)
    steps = run_until_done(engine, collector)
    return {r.request_id: collector.tokens(r.request_id) for r in requests}, steps


def test_chunked_prefill_splitting_an_image_equals_monolithic(qwen3_dir):
    messages = user(text("Look:"), image(200, 240, 9), text("What is it?"))
    request = plan_request(qwen3_dir, messages, "chunked", MAX_TOKENS)
    [(rng, emb)] = request.media
    budget = 16
    assert rng.num_embeds > 2 * budget and rng.offset % budget != 0  # the image spans 3+ chunks
    tokens, _ = _engine_tokens(qwen3_dir, [request], max_num_batched_tokens=budget)
    assert tokens["chunked"] == reference_generate(qwen3_dir, messages, MAX_TOKENS)


def test_zeroed_deepstack_parts_change_the_output(qwen3_dir):
    """Same embeddings, DeepStack parts zeroed: other greedy tokens (the LM face uses them)."""
    request = plan_request(qwen3_dir, _case("one_image"), "full", 12)
    zeroed = dataclasses.replace(request, request_id="zeroed", media=tuple(
        (rng, ItemEmbedding((emb.parts[0], *map(torch.zeros_like, emb.parts[1:])), emb.key + "-zeroed"))
        for rng, emb in request.media
    ))
    tokens, _ = _engine_tokens(qwen3_dir, [request, zeroed])
    assert tokens["full"] == reference_generate(qwen3_dir, _case("one_image"), 12)
    assert tokens["zeroed"] != tokens["full"]


# --- router: the processor's prompt and get_rope_index's positions, from headers alone ---------

@st.composite
def prompts(draw):
    """Messages with 0..3 images / videos (2..7 frames, several fps) between text pieces."""
    parts = [text(draw(st.sampled_from(["", "Hi ", "Look at this: "])))]
    for i in range(draw(st.integers(0, 3))):
        h, w = draw(st.integers(20, 160)), draw(st.integers(20, 160))
        if draw(st.booleans()):
            parts.append(image(h, w, i))
        else:
            fps = draw(st.sampled_from([0.5, 1.0, 2.0, 3.0, 24.0]))
            parts.append(video(draw(st.integers(2, 7)), h, w, i, fps))
        parts.append(text(draw(st.sampled_from(["", " and ", "?"]))))
    return user(*[p for p in parts if p.get("text", True) != ""] or [text("x")])


@settings(max_examples=30, deadline=None)
@given(messages=prompts())
def test_router_prompt_and_positions_equal_processor_and_get_rope_index(qwen3_dir, messages):
    planner, _, _ = runtimes(qwen3_dir)
    plan = planner.plan(to_planner_messages(messages))
    inputs = reference_inputs(qwen3_dir, messages)
    assert list(plan.token_ids) == inputs["input_ids"][0].tolist()
    _, model = load_reference(qwen3_dir)
    kwargs = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "mm_token_type_ids") if k in inputs}
    ref, delta = model.model.get_rope_index(inputs["input_ids"], attention_mask=inputs["attention_mask"], **kwargs)
    n = len(plan.token_ids)
    assert torch.equal(plan.positions.positions(0, n), ref[:, 0])
    assert torch.equal(plan.positions.positions(n, n + 3), (torch.arange(n, n + 3) + int(delta)).expand(3, -1))


def test_split_video_parts_concatenate_to_the_whole(qwen3_dir):
    """Temporal groups encoded apart give the whole video's embeddings and DeepStack features."""
    _, enc, _ = runtimes(qwen3_dir)
    item = MediaItem(MediaKind.VIDEO, tuple(video_frames(6, 64, 96, 9)), fps=2.0)
    prepared = enc.preprocess(enc.plan(item))
    [whole] = enc.forward([prepared])
    per_group = prepared.num_tokens // prepared.layout[0]
    pieces = enc.split(prepared, per_group, "tokens")
    assert len(pieces) == prepared.layout[0] == 3
    got = ItemEmbedding.concat(enc.forward(pieces), "k")
    assert len(got.parts) == len(whole) > 1
    for g, w in zip(got.parts, whole):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_video_shorter_than_a_temporal_patch_is_invalid(qwen3_dir):
    planner, _, _ = runtimes(qwen3_dir)
    with pytest.raises(InvalidRequest, match="at least 2 frames"):
        planner.plan(to_planner_messages(user(video(1, 64, 64, 1, fps=2.0), text("?"))))


def test_batched_requests_with_deepstack_share_forwards_and_equal_monolithic(qwen3_dir):
    """Several media requests in the same forwards, prompts chunked (DeepStack rows of several
    sequences and items packed into one mask)."""
    names = ["one_image", "image_and_video", "three_images"]
    requests = [plan_request(qwen3_dir, _case(n), n, MAX_TOKENS) for n in names]
    tokens, steps = _engine_tokens(qwen3_dir, requests, max_num_batched_tokens=48)
    assert steps < sum(len(r.prompt_token_ids) // 48 + MAX_TOKENS for r in requests)  # forwards were shared
    for n in names:
        assert tokens[n] == reference_generate(qwen3_dir, _case(n), MAX_TOKENS), n
