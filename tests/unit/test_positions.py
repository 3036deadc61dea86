"""Router M-RoPE positions == `transformers`' `get_rope_index` of the monolithic model (property-based).

The reference is the model's own `get_rope_index`, driven only by token types and grids; the
project side is `mmserve.inputs.mrope.mrope_positions` fed the same layout as placeholder ranges.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmserve.inputs.media import PlaceholderRange
from mmserve.inputs.mrope import mrope_positions, video_t_factor
from mmserve.inputs.positions import ExplicitPositions

MERGE = 2
TEMPORAL_PATCH = 2
FPS_CHOICES = (0.5, 1.0, 2.0, 3.0, 4.0)
TEXT, IMAGE, VIDEO = 0, 1, 2


@functools.lru_cache(maxsize=4)
def reference_model(model_dir: str):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


@st.composite
def layouts(draw):
    """(items, text_lengths): items are (kind, (t, h, w), fps); text_lengths has len(items) + 1 entries.

    Zero-length text is allowed between adjacent items of different kinds. Two adjacent items of the
    same kind with no token between them are indistinguishable by token type (transformers groups
    runs of equal types), and real prompts always separate items with vision start/end tokens.
    """
    n = draw(st.integers(0, 5))
    even = st.integers(1, 12).map(lambda x: 2 * x)
    items = []
    for _ in range(n):
        kind = draw(st.sampled_from((IMAGE, VIDEO)))
        t = 1 if kind == IMAGE else draw(st.integers(1, 6))
        fps = draw(st.sampled_from(FPS_CHOICES)) if kind == VIDEO else None
        items.append((kind, (t, draw(even), draw(even)), fps))
    texts = [draw(st.integers(0, 20))]
    for i in range(1, n + 1):
        same_kind_neighbours = i < n and items[i - 1][0] == items[i][0]
        texts.append(draw(st.integers(1 if same_kind_neighbours else 0, 20)))
    return items, texts


def _build(items, texts, vocab_size: int, placeholder_ids: set[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    text_ids = [i for i in range(vocab_size) if i not in placeholder_ids]
    ids: list[int] = []
    types: list[int] = []
    ranges: list[PlaceholderRange] = []

    def add_text(k):
        picks = torch.randint(len(text_ids), (k,), generator=gen).tolist()
        ids.extend(text_ids[p] for p in picks)
        types.extend([TEXT] * k)

    add_text(texts[0])
    for (kind, (t, h, w), _fps), after in zip(items, texts[1:]):
        length = t * (h // MERGE) * (w // MERGE)
        ranges.append(PlaceholderRange(len(ids), length))
        ids.extend([sorted(placeholder_ids)[kind - 1]] * length)
        types.extend([kind] * length)
        add_text(after)
    return ids, types, ranges


def _reference(model, family, ids, types, items):
    images = [g for k, g, _ in items if k == IMAGE]
    videos = [g for k, g, _ in items if k == VIDEO]
    kwargs = {}
    if family == "qwen2_5_vl" and videos:
        kwargs["second_per_grid_ts"] = torch.tensor(
            [TEMPORAL_PATCH / fps for k, _, fps in items if k == VIDEO], dtype=torch.float32
        )
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
        pos, delta = model.model.get_rope_index(
            input_ids,
            torch.tensor([types], dtype=torch.int),
            image_grid_thw=torch.tensor(images, dtype=torch.long) if images else None,
            video_grid_thw=torch.tensor(videos, dtype=torch.long) if videos else None,
            attention_mask=torch.ones_like(input_ids),
            **kwargs,
        )
    return pos[:, 0], int(delta.reshape(-1)[0])


def _project_t_factors(model, family, items):
    tps = getattr(model.config.vision_config, "tokens_per_second", None)
    out = []
    for kind, _grid, fps in items:
        if family == "qwen2_5_vl" and kind == VIDEO:
            out.append(video_t_factor(TEMPORAL_PATCH / fps, tps))
        else:
            out.append(1)
    return out


def test_reference_config_matches_assumptions(model_dir, family):
    cfg = reference_model(model_dir).config.vision_config
    assert cfg.spatial_merge_size == MERGE
    assert cfg.temporal_patch_size == TEMPORAL_PATCH
    if family == "qwen2_5_vl":
        assert cfg.tokens_per_second > 0


@pytest.mark.parametrize("fam", ["qwen2_vl", "qwen2_5_vl"])
@settings(max_examples=150, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**16))
def test_positions_match_get_rope_index(tiny_models, fam, layout, seed):
    items, texts = layout
    model_dir = tiny_models[fam]
    model = reference_model(model_dir)
    cfg = model.config
    placeholders = {cfg.image_token_id, cfg.video_token_id}
    assert cfg.image_token_id < cfg.video_token_id  # _build maps kind 1/2 to the sorted pair
    ids, types, ranges = _build(items, texts, cfg.text_config.vocab_size, placeholders, seed)
    if not ids:
        # get_rope_index cannot handle an empty sequence; the project returns empty positions.
        pos, delta = mrope_positions(0, [], [], MERGE, [])
        assert pos.shape == (3, 0) and delta == 0
        return

    ref_pos, ref_delta = _reference(model, fam, ids, types, items)
    pos, delta = mrope_positions(
        len(ids), ranges, [g for _, g, _ in items], MERGE, _project_t_factors(model, fam, items)
    )
    assert pos.dtype == torch.int64
    assert pos.shape == (3, len(ids))
    assert torch.equal(pos, ref_pos.to(torch.int64)), (items, texts)
    assert delta == ref_delta


def test_qwen2_5_video_temporal_scaling_is_exercised(tiny_models):
    """A guard that the property test above covers non-trivial t_factors (not all 1)."""
    model = reference_model(tiny_models["qwen2_5_vl"])
    tps = model.config.vision_config.tokens_per_second
    factors = {float(video_t_factor(TEMPORAL_PATCH / fps, tps)) for fps in FPS_CHOICES}
    assert len(factors) == len(FPS_CHOICES)
    items = [(VIDEO, (4, 4, 4), 0.5)]
    ids, types, ranges = _build(items, [3, 2], model.config.text_config.vocab_size,
                                {model.config.image_token_id, model.config.video_token_id}, 0)
    ref_pos, ref_delta = _reference(model, "qwen2_5_vl", ids, types, items)
    pos, delta = mrope_positions(len(ids), ranges, [(4, 4, 4)], MERGE, _project_t_factors(model, "qwen2_5_vl", items))
    # fps 0.5 -> t_factor 8: temporal positions 3, 11, 19, 27 dominate the spatial extent.
    assert sorted(set(pos[0, 3:3 + 16].tolist())) == [3, 11, 19, 27]
    assert torch.equal(pos, ref_pos) and delta == ref_delta


def test_decode_position_matches_generate(model_dir, family):
    """Positions `generate` feeds the decoder at each decode step == the position plan's."""
    from tests.support.media_factory import image_bytes, video_frames
    from tests.support.reference import reference_inputs

    messages = [{"role": "user", "content": [
        {"type": "image", "bytes": image_bytes(56, 112, 1)},
        {"type": "text", "text": "and"},
        {"type": "video", "frames": video_frames(4, 84, 56, 2), "fps": 0.5},
        {"type": "text", "text": "go"},
    ]}]
    inputs = reference_inputs(model_dir, messages)
    model = reference_model(model_dir)
    cfg = model.config
    ids = inputs["input_ids"][0].tolist()
    num_prompt = len(ids)

    # project positions from the processor's own layout
    ranges, grids, kinds = [], [], []
    i = 0
    while i < num_prompt:
        if ids[i] in (cfg.image_token_id, cfg.video_token_id):
            j = i
            while j < num_prompt and ids[j] == ids[i]:
                j += 1
            ranges.append(PlaceholderRange(i, j - i))
            kinds.append(IMAGE if ids[i] == cfg.image_token_id else VIDEO)
            i = j
        else:
            i += 1
    assert kinds == [IMAGE, VIDEO]
    grids = [tuple(inputs["image_grid_thw"][0].tolist()), tuple(inputs["video_grid_thw"][0].tolist())]
    t_factors = [1, 1]
    if family == "qwen2_5_vl":
        t_factors[1] = video_t_factor(float(inputs["second_per_grid_ts"][0]), cfg.vision_config.tokens_per_second)
    prompt_positions, delta = mrope_positions(num_prompt, ranges, grids, MERGE, t_factors)
    plan = ExplicitPositions(prompt_positions, delta)
    assert delta != 0  # the test must distinguish M-RoPE decode positions from plain ones

    seen: list[torch.Tensor] = []

    def hook(_module, _args, kwargs):
        seen.append(kwargs["position_ids"].detach().clone())

    handle = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.inference_mode():
            model.generate(**inputs, do_sample=False, max_new_tokens=4, min_new_tokens=4)
    finally:
        handle.remove()
    assert len(seen) == 4  # prefill + 3 decode steps
    for step, pos in enumerate(seen[1:]):
        # generate may prepend a text-position row (4 rows); the M-RoPE rows are the last 3
        mrope = pos[-3:].reshape(3, -1)[:, -1]
        assert mrope.tolist() == plan.positions(num_prompt + step, num_prompt + step + 1)[:, 0].tolist(), step
        assert mrope.tolist() == [num_prompt + delta + step] * 3, step
