"""A tiny checkpoint as the released Qwen2-VL / Qwen2.5-VL checkpoints lay it out: the same files,
config.json flat (`mmserve.tiny.qwen2_vl.published_layout`)."""

from __future__ import annotations

import json
from pathlib import Path

from mmserve.tiny.qwen2_vl import published_layout


def flat_copy(model_dir: str, out: Path) -> str:
    """`model_dir`'s files linked into `out`, its config.json rewritten flat; returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for file in Path(model_dir).iterdir():
        if file.name != "config.json":
            (out / file.name).symlink_to(file.resolve())
    nested = json.loads((Path(model_dir) / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(published_layout(nested), indent=2) + "\n")
    return str(out)
