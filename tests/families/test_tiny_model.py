"""The tiny checkpoints: real HF directories, every one deterministic (`mmserve build-tiny-model`);
the Qwen2-VL families' load with the stock Auto classes (the others': their families' modules)."""

import hashlib
from pathlib import Path

import pytest

from deployments.cli.main import main
from mmserve.tiny import CHAT_TEMPLATE, FAMILIES, SPECIAL_TOKENS, build_tiny_model


def _digests(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("name", FAMILIES)
def test_cli_builds_the_same_bytes_and_another_seed_other_weights(tmp_path, capsys, tiny_checkpoint, name):
    assert main(["build-tiny-model", "--family", name, "--out", str(tmp_path / "again")]) == 0
    assert str(tmp_path / "again") in capsys.readouterr().out
    again = _digests(tmp_path / "again")
    assert "model.safetensors" in again and again == _digests(Path(tiny_checkpoint(name)))
    other = build_tiny_model(name, tmp_path / "other", seed=1)
    assert _digests(other)["model.safetensors"] != again["model.safetensors"]


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
