"""Seeded request mix and arrival process for `bench/serve.py` (the shape of vLLM's `random-mm`),
and the seeded images the benches and tests send.

Pure Python: no Ray, no model. Everything is drawn from one `random.Random(seed)`, so the same
arguments give the same requests and the same send times.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResolutionBucket:
    height: int
    width: int
    probability: float


@dataclass(frozen=True)
class DatasetConfig:
    """What one benchmark request looks like.

    buckets: image resolutions with their probabilities (normalised when drawn).
    max_images: images per image request, uniform in 1..max_images.
    text_only_share: share of requests with no image.
    repeat_share: share of images that repeat an earlier image of this run (encoder cache hits),
    or, with `image_pool` > 0, that are one of `image_pool` fixed images (the same in every run
    of this seed: a workload's popular images).
    system_prompts / system_share: that share of requests opens with one of `system_prompts`
    system prompts of `system_words` words (prompt prefixes shared across requests).
    input_len / output_len: mean text tokens of the prompt / max_tokens; range_ratio spreads them
    uniformly over mean*(1-r)..mean*(1+r), as vLLM's `--random-range-ratio`.
    """

    buckets: tuple[ResolutionBucket, ...] = (
        ResolutionBucket(256, 256, 0.5), ResolutionBucket(512, 512, 0.3), ResolutionBucket(640, 640, 0.2))
    max_images: int = 2
    text_only_share: float = 0.2
    repeat_share: float = 0.1
    input_len: int = 32
    output_len: int = 16
    range_ratio: float = 0.25
    image_pool: int = 0
    system_prompts: int = 0
    system_share: float = 0.0
    system_words: int = 48


QUICK_BUCKETS = (ResolutionBucket(112, 112, 0.3), ResolutionBucket(224, 224, 0.5), ResolutionBucket(336, 336, 0.2))


@dataclass(frozen=True)
class ImageSpec:
    """One image to synthesise: `seed` fixes its pixels, so a repeated image has the same seed."""

    height: int
    width: int
    seed: int


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_words: int
    max_tokens: int
    images: tuple[ImageSpec, ...] = field(default_factory=tuple)
    system: int | None = None  # which shared system prompt opens the request (None: none)
    text_seed: int = 0  # draws the request's words: no two requests' texts share a prefix by accident


WORDS = ("describe", "the", "picture", "in", "detail", "and", "count", "objects", "colors", "shapes", "left",
         "right", "top", "bottom", "text", "people")


def _spread(rng: random.Random, mean: int, ratio: float) -> int:
    low = max(1, int(round(mean * (1 - ratio))))
    return rng.randint(low, max(low, int(round(mean * (1 + ratio)))))


def generate_requests(config: DatasetConfig, num_requests: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    text_rng = random.Random(seed ^ 0x7E47)  # apart from `rng`: the same images, lengths and prompts as before
    weights = [bucket.probability for bucket in config.buckets]
    pool_rng = random.Random(0x9001)  # the popular images do not depend on the run's seed
    pool = [ImageSpec(b.height, b.width, 900_000_000 + k)
            for k, b in enumerate(pool_rng.choices(config.buckets, weights=weights, k=config.image_pool))]
    seen: list[ImageSpec] = []
    requests: list[RequestSpec] = []
    next_image_seed = seed * 1_000_003
    for index in range(num_requests):
        images: list[ImageSpec] = []
        if rng.random() >= config.text_only_share:
            for _ in range(rng.randint(1, config.max_images)):
                if (pool or seen) and rng.random() < config.repeat_share:
                    images.append(rng.choice(pool or seen))
                    continue
                bucket = rng.choices(config.buckets, weights=weights)[0]
                next_image_seed += 1
                spec = ImageSpec(bucket.height, bucket.width, next_image_seed)
                seen.append(spec)
                images.append(spec)
        requests.append(RequestSpec(
            index=index, prompt_words=_spread(rng, config.input_len, config.range_ratio),
            max_tokens=_spread(rng, config.output_len, config.range_ratio), images=tuple(images),
            system=rng.randrange(config.system_prompts) if rng.random() < config.system_share else None,
            text_seed=text_rng.getrandbits(32)))
    return requests


def arrival_times(num_requests: int, request_rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send offsets in seconds from the start, as vLLM's `--request-rate` / `--burstiness`: gamma
    gaps of mean 1/rate and coefficient of variation 1/sqrt(burstiness) (1: Poisson); an infinite
    rate sends everything at time 0."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed ^ 0x5EED)
    gaps = [rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness)) for _ in range(num_requests)]
    return list(itertools.accumulate(gaps, initial=0.0))[:num_requests]


def synthesize_image(spec: ImageSpec) -> bytes:
    """PNG bytes of a seeded random image (numpy and PIL imported lazily)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(spec.seed).integers(0, 256, (spec.height, spec.width, 3), dtype=np.uint8)
    return _encoded(Image.fromarray(pixels), "PNG")


def image_bytes(height: int, width: int, seed: int, fmt: str = "PNG", exif_orientation: int | None = None) -> bytes:
    """A seeded image, smooth-ish (so JPEG round trips stay meaningful), encoded as `fmt`."""
    import numpy as np
    from PIL import Image

    base = np.random.default_rng(seed).integers(0, 255, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((width, height), Image.BILINEAR)
    if exif_orientation is None:
        return _encoded(img, fmt)
    exif = Image.Exif()
    exif[0x0112] = exif_orientation
    return _encoded(img, fmt, exif=exif)


def _encoded(image, fmt: str, **options) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(data).decode()


def system_text(index: int, words: int) -> str:
    vocabulary = ("you", "are", "a", "careful", "assistant", "for", "images", "answer", "briefly", "and", "kindly")
    return f"Role {index}: " + " ".join(vocabulary[(index * 7 + i) % len(vocabulary)] for i in range(words))


def prompt_text(spec: RequestSpec) -> str:
    """The request's words, drawn by its `text_seed`: only what the workload shares (system prompts,
    repeated images) makes prefix-cache hits. Words cycled from the request's index gave every
    run's request k the text of every other run's request k: hits no workload asked for."""
    rng = random.Random(spec.text_seed)
    return " ".join(rng.choice(WORDS) for _ in range(spec.prompt_words))
