"""Released Qwen2-VL and Qwen2.5-VL checkpoints write a flat config.json (the language model's
fields at the top level, `rope_scaling: {"type": "mrope", ...}`); `transformers` 5 saves them
nested under `text_config`. Every reader (router face, the router's context length, both runtimes)
gets the same numbers from either, and the served tokens are the same.

The other registered families' released checkpoints (Qwen3-VL, LLaVA-hf, Step3, MiniCPM-V 4.6)
nest their text config, so the flat layout is tested for these two only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmserve.checkpoint import load_config, resolve_max_model_len
from mmserve.families import router_face
from tests.support.cases import cases
from tests.support.core_fakes import make_core
from tests.support.layouts import flat_copy
from tests.support.pipeline import served_generate
from tests.support.reference import reference_generate

FLAT_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
TEXT_FIELDS = ("max_position_embeddings", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "rms_norm_eps", "bos_token_id", "eos_token_id",
               "pad_token_id", "layer_types", "sliding_window")


@pytest.fixture(scope="module", params=FLAT_FAMILIES)
def layouts(request, tiny_checkpoint, tmp_path_factory) -> tuple[str, str]:
    """(nested, flat) checkpoint directories of one family, the same weights."""
    nested = tiny_checkpoint(request.param)
    return nested, flat_copy(nested, tmp_path_factory.mktemp(f"{request.param}-flat"))


def test_the_flat_copy_is_the_published_layout(layouts):
    nested, flat = layouts
    raw = json.loads((Path(flat) / "config.json").read_text())
    assert "text_config" not in raw and "text_config" in json.loads((Path(nested) / "config.json").read_text())
    assert raw["max_position_embeddings"] == 4096 and raw["hidden_size"] == 64
    assert raw["rope_scaling"]["type"] == "mrope" and raw["rope_scaling"]["mrope_section"] == [2, 3, 3]
    assert "model_type" not in raw["vision_config"]


def test_the_config_classes_read_both_layouts_alike(layouts):
    nested, flat = (load_config(d) for d in layouts)
    a, b = nested.get_text_config(), flat.get_text_config()
    assert {f: getattr(b, f) for f in TEXT_FIELDS} == {f: getattr(a, f) for f in TEXT_FIELDS}
    assert b.rope_parameters["mrope_section"] == a.rope_parameters["mrope_section"] == [2, 3, 3]
    assert b.rope_parameters["rope_theta"] == a.rope_parameters["rope_theta"]
    assert b.rope_parameters["rope_type"] == a.rope_parameters["rope_type"] == "default"
    assert flat.tie_word_embeddings == nested.tie_word_embeddings
    vision = [{k: v for k, v in c.vision_config.to_dict().items() if k != "dtype"} for c in (flat, nested)]
    assert vision[0] == vision[1]


def test_the_router_reads_both_layouts_alike(layouts):
    nested, flat = layouts
    assert router_face(flat) == router_face(nested)
    assert make_core(flat).max_model_len == make_core(nested).max_model_len == 4096
    assert make_core(flat, engine={"max_model_len": 100}).max_model_len == 100
    assert resolve_max_model_len(load_config(flat), None) == 4096


def test_a_flat_checkpoint_serves_the_tokens_of_the_monolithic_model(layouts):
    """The runtimes on the flat copy == `generate` on the nested original (and on the flat one)."""
    nested, flat = layouts
    messages = cases()["one_image"]
    expected = reference_generate(nested, messages, 8)
    assert served_generate(flat, messages, 8) == expected
    assert reference_generate(flat, messages, 8) == expected
