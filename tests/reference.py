"""The reference side: `transformers` only (apply_chat_template + processor + generate).

Never uses the project's tokenization, expansion or positions.
"""

from __future__ import annotations

import functools
import io

import torch
from PIL import Image


@functools.lru_cache(maxsize=4)
def load_reference(model_dir: str, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).eval()
    return processor, model


def _pil(data: bytes) -> Image.Image:
    from transformers.image_utils import load_image

    return load_image(Image.open(io.BytesIO(data)))


def reference_inputs(model_dir: str, messages: list[dict]):
    """`messages` in the processor's chat shape with media given as
    `{"type": "image", "bytes": b}` / `{"type": "video", "frames": [b, ...], "fps": f}`."""
    processor, _ = load_reference(model_dir)
    images, videos, metadata = [], [], []
    chat = []
    for m in messages:
        content = []
        for part in m["content"]:
            if part["type"] == "image":
                images.append(_pil(part["bytes"]))
                content.append({"type": "image"})
            elif part["type"] == "video":
                frames = [_pil(f) for f in part["frames"]]
                videos.append(frames)
                n = len(frames)
                metadata.append({"total_num_frames": n, "fps": part.get("fps", 2.0), "frames_indices": list(range(n))})
                content.append({"type": "video"})
            else:
                content.append(part)
        chat.append({"role": m["role"], "content": content})
    text = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    kwargs = {}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs.update(videos=videos, video_metadata=metadata, do_sample_frames=False)
    return processor(text=[text], return_tensors="pt", **kwargs)


def reference_generate(model_dir: str, messages: list[dict], max_new_tokens: int) -> list[int]:
    """Greedy tokens of the monolithic model, without the trailing EOS token."""
    _, model = load_reference(model_dir)
    inputs = reference_inputs(model_dir, messages)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    return tokens
