"""The tiny checkpoints: real HF directories, deterministic, loadable by the stock Auto classes."""

import hashlib
from pathlib import Path

import pytest

from deployments.cli.main import main
from mmserve.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_model


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tiny_models):
    again = build_tiny_model("qwen2_vl", tmp_path / "again", seed=0)
    assert _digests(again) == _digests(Path(tiny_models["qwen2_vl"]))
    other = build_tiny_model("qwen2_vl", tmp_path / "other", seed=1)
    assert _digests(other)["model.safetensors"] != _digests(again)["model.safetensors"]


def test_cli_builds_a_checkpoint(tmp_path, capsys):
    assert main(["build-tiny-model", "--family", "qwen2_5_vl", "--out", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "model.safetensors").is_file()
    assert str(tmp_path / "m") in capsys.readouterr().out


def test_loads_with_auto_classes(model_dir, family):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    assert model.config.model_type == family
    tok = processor.tokenizer
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert len(set(ids.values())) == len(SPECIAL_TOKENS) and None not in ids.values()
    assert model.config.image_token_id == ids["<|image_pad|>"]
    assert model.config.video_token_id == ids["<|video_pad|>"]
    assert processor.chat_template == CHAT_TEMPLATE
    assert model.config.text_config.vocab_size >= len(tok)


def test_unknown_family_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        build_tiny_model("llava_next", tmp_path / "x")
