"""The reference side: `transformers` only (apply_chat_template + processor + generate).

Never uses the project's tokenization, expansion or positions.
"""

from __future__ import annotations

import functools
import io
from typing import NamedTuple

import torch
from PIL import Image

# bf16 rounding may flip a greedy token only where the reference's logit of our token is within
# this of its best one (the tiny models' random logits are flat, so near-ties are common)
NEAR_TIE = 0.125


@functools.lru_cache(maxsize=8)
def load_processor(model_dir: str):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(model_dir)


def load_reference(model_dir: str, dtype: torch.dtype = torch.float64, device: str = "cpu"):
    """(processor, monolithic model), loaded once per (model_dir, dtype, device) however they are passed."""
    return _load_reference(model_dir, dtype, device)


@functools.lru_cache(maxsize=4)
def _load_reference(model_dir: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForImageTextToText

    # MoE layers: transformers' own per-expert loop (its grouped kernels take no float64)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype,
                                                        experts_implementation="eager").to(device).eval()
    return load_processor(model_dir), model


@functools.lru_cache(maxsize=4)
def load_merged_reference(model_dir: str, adapter_dir: str, dtype: torch.dtype = torch.float64):
    """The monolithic model with the LoRA adapter `adapter_dir` merged into its weights by `peft`
    (`PeftModel.from_pretrained(...).merge_and_unload()`): the reference of an adapter's output."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype)  # its own copy: merged in place
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def drop_references() -> None:
    """Forget the loaded models (a large one need not stay for the rest of the session)."""
    _load_reference.cache_clear()
    load_merged_reference.cache_clear()


def _pil(data: bytes) -> Image.Image:
    from transformers.image_utils import load_image

    return load_image(Image.open(io.BytesIO(data)))


def reference_inputs(model_dir: str, messages: list[dict]):
    """`messages` in the processor's chat shape with media given as
    `{"type": "image", "bytes": b}` / `{"type": "video", "frames": [b, ...], "fps": f}` /
    `{"type": "video_file", "bytes": mp4}`."""
    processor = load_processor(model_dir)
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
            elif part["type"] == "video_file":
                frames, meta = load_video_file(model_dir, part["bytes"])
                videos.append(frames)
                metadata.append(meta)
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


def load_video_file(model_dir: str, data: bytes, **sampling):
    """Frames and metadata of a video file as `transformers`' own loader gives them: PyAV, sampled
    by the checkpoint's `video_processor.sample_frames` (with `sampling`: a request's fps or
    num_frames, as vLLM passes `mm_processor_kwargs`). Where neither they nor the processor's config
    name a rate (Qwen2-VL's), at 2 fps: the rate the server documents (`mmserve.video.container.DEFAULT_SAMPLE_FPS`)."""
    import inspect
    import tempfile

    from transformers.video_utils import load_video

    from mmserve.video.container import DEFAULT_SAMPLE_FPS

    vp = load_processor(model_dir).video_processor
    kwargs = dict(sampling)
    if not sampling and (getattr(vp, "fps", None) is None and getattr(vp, "num_frames", None) is None
            and "fps" in inspect.signature(vp.sample_frames).parameters):
        kwargs["fps"] = DEFAULT_SAMPLE_FPS
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        frames, metadata = load_video(f.name, backend="pyav", sample_indices_fn=functools.partial(vp.sample_frames, **kwargs))
    metadata.frames_indices = [int(i) for i in metadata.frames_indices]
    return frames, metadata


def reference_generate(model_dir: str, messages: list[dict], max_new_tokens: int,
                       dtype: torch.dtype = torch.float64, adapter: str | None = None, **generate) -> list[int]:
    """Greedy tokens of the monolithic model (with the LoRA adapter directory `adapter` merged:
    `load_merged_reference`), without the trailing EOS token (`generate`: more arguments of
    `generate`, e.g. a repetition penalty)."""
    if adapter is None:
        _, model = load_reference(model_dir, dtype)
    else:
        model = load_merged_reference(model_dir, adapter, dtype)
    inputs = reference_inputs(model_dir, messages)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **generate)
    tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    return tokens


class GreedyReference(NamedTuple):
    """`generate`'s greedy tokens (its EOS included) and its logits at each of them."""

    tokens: list[int]
    logits: tuple[torch.Tensor, ...]
    eos: frozenset[int]


_GREEDY: dict[tuple, GreedyReference] = {}


def greedy_reference(model_dir: str, messages: list[dict], max_new_tokens: int, dtype: torch.dtype = torch.bfloat16,
                     device: str = "cuda", key: str | None = None) -> GreedyReference:
    """`generate` (greedy) with its logits at each token; cached under `key` (a case name) if given."""
    cache_key = (model_dir, key, max_new_tokens, dtype, device)
    if key is not None and cache_key in _GREEDY:
        return _GREEDY[cache_key]
    _, model = load_reference(model_dir, dtype, device)
    inputs = reference_inputs(model_dir, messages).to(device)
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens,
                             output_logits=True, return_dict_in_generate=True)
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    ref = GreedyReference(out.sequences[0, inputs["input_ids"].shape[1]:].tolist(),
                          tuple(step[0].float().cpu() for step in out.logits), frozenset(eos))
    if key is not None:
        _GREEDY[cache_key] = ref
    return ref


class Split(NamedTuple):
    index: int  # the first generated token that differs
    gap: float  # how far below the reference's best logit there our token's logit is
    spread: float  # the std of the reference's logits there


def split_from_reference(got: list[int], stopped_on_eos: bool, ref: GreedyReference) -> Split | None:
    """Where greedy tokens `got` (served: the EOS left out; `stopped_on_eos` if they ended on one)
    first leave the reference's, or None where they are the same."""
    got = list(got)
    want = ref.tokens
    if stopped_on_eos:
        got.append(want[len(got)] if len(want) > len(got) and want[len(got)] in ref.eos else min(ref.eos))
    if got == want:
        return None
    index = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if index >= len(ref.logits) or index >= len(got):
        return Split(index, float("inf"), 0.0)  # one ended where the other went on
    scores = ref.logits[index]
    return Split(index, float(scores.max() - scores[got[index]]), float(scores.std()))


class NearTieTally:
    """The near-tie rule over many outputs: each either equals the reference or splits from it
    where the reference's logit of our token is within NEAR_TIE of its best (asserted per case);
    `exact` counts the identical ones."""

    def __init__(self):
        self.exact = 0
        self.splits: list[tuple[str, int, float, float]] = []

    def check(self, name: str, got: list[int], stopped_on_eos: bool, ref: GreedyReference) -> None:
        split = split_from_reference(got, stopped_on_eos, ref)
        if split is None:
            self.exact += 1
            return
        self.splits.append((name, split.index, round(split.gap, 4), round(split.spread, 3)))
        assert split.gap < NEAR_TIE, f"{name}: split at token {split.index}, {split.gap:.4f} below the reference's top logit"

    def summary(self, total: int) -> str:
        return f"{self.exact}/{total} identical; splits (case, token, gap, logit std): {self.splits}"


class GrammarMask:
    """A `transformers` logits processor applying llguidance's mask of a JSON schema (compact JSON,
    as the engine compiles it; `schema` None: any JSON object) step by step to `generate`'s logits:
    the reference of constrained decoding, written on the library alone (not the engine's code)."""

    def __init__(self, model_dir: str, schema: dict | None, prompt_len: int):
        import json

        import llguidance.hf
        import llguidance.torch

        processor, model = load_reference(model_dir)
        eos = model.generation_config.eos_token_id
        vocab = model.config.get_text_config().vocab_size
        tokenizer = llguidance.hf.from_tokenizer(processor.tokenizer, n_vocab=vocab,
                                                 eos_token=[eos] if isinstance(eos, int) else list(eos))
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema or {"type": "object"}),
                                                                defaults={"whitespace_flexible": False})
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        self.fill = llguidance.torch.fill_next_token_bitmask
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:  # the token generate picked last step
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        self.fill(self.matcher, self.bitmask, 0)
        bits = (self.bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten(1)[:, :scores.shape[-1]].bool()
        return scores.masked_fill(~allowed, float("-inf"))


def reference_constrained(model_dir: str, messages: list[dict], max_new_tokens: int, schema: dict | None) -> list[int]:
    """`reference_generate` with `GrammarMask` (greedy, float64)."""
    prompt_len = reference_inputs(model_dir, messages)["input_ids"].shape[1]
    return reference_generate(model_dir, messages, max_new_tokens,
                              logits_processor=[GrammarMask(model_dir, schema, prompt_len)])
