"""A checkpoint at real widths through the Serve app: Qwen2.5-VL-3B-Instruct's dimensions (hidden
2048, vocab 151,936, 128,000-token context, window-attention ViT of width 1280) with 2 text layers
and 2 ViT blocks, random weights, config.json in the released flat layout
(`mmserve.loadgen.checkpoints.qwen2_5_vl_3b`). One image request served == `transformers`
monolithic `generate` on the same checkpoint, in float32 (greedy, 8 tokens)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.cases import image, openai_chat, text, user
from tests.support.reference import drop_references, reference_generate
from tests.support.serve_fixtures import _app_args

pytestmark = pytest.mark.serve

NAME = "qwen2-5-vl-3b-flat"
# 196 x 308 px: 7 x 11 merged patches, not a whole number of 4 x 4 attention windows
MESSAGES = user(image(196, 308, 11), text("Describe this picture."))


@pytest.fixture(scope="module")
def real_size_dir(models_root) -> str:
    from mmserve.loadgen.checkpoints import qwen2_5_vl_3b

    return qwen2_5_vl_3b(os.path.join(models_root, "qwen2_5_vl_3b_flat_2x2"), text_layers=2, vision_depth=2, flat=True)


@pytest.fixture(scope="module")
def expected(real_size_dir) -> list[int]:
    tokens = reference_generate(real_size_dir, MESSAGES, 8, dtype=torch.float32)
    drop_references()  # ~2 GB of float32 weights: not kept for the rest of the session
    return tokens


@pytest.fixture(scope="module")
def real_size_url(real_size_dir, expected, serve_ports):
    """The app (float32; the default CPU KV pool of 512 MiB holds one 128,000-token sequence of 2 layers)."""
    from ray import serve

    from deployments.serve.app import build_app

    serve.run(build_app(_app_args(real_size_dir, NAME, dtype="float32")), name=NAME, route_prefix=f"/{NAME}")
    try:
        yield f"http://127.0.0.1:{serve_ports[0]}/{NAME}"
    finally:
        serve.delete(NAME)


def test_the_checkpoint_is_flat_at_real_widths(real_size_dir):
    config = json.loads((Path(real_size_dir) / "config.json").read_text())
    assert "text_config" not in config and config["rope_scaling"] == {"type": "mrope", "mrope_section": [16, 24, 24]}
    assert (config["hidden_size"], config["vocab_size"], config["max_position_embeddings"]) == (2048, 151936, 128000)
    assert config["vision_config"]["fullatt_block_indexes"] == [7, 15, 23, 31]


def test_one_image_served_equals_monolithic_and_the_context_is_the_checkpoints(real_size_url, expected):
    models = httpx.get(real_size_url + "/v1/models", timeout=60).json()
    assert models["data"][0]["max_model_len"] == 128000
    _, tokens = openai_chat(real_size_url, NAME, MESSAGES, 8, stream=False)
    assert tokens == expected and len(expected) == 8
