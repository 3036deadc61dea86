"""Batched (pooled, packed, split) encoder output == one-item-at-a-time output, on the tiny checkpoints."""

import asyncio
import functools
import random

import pytest
import torch

from encoder_service import VisionEncoder
from encoder_service.batching import BatchConfig
from encoder_service.pool import EncoderPool, PoolConfig
from mmserve.inputs.media import MediaItem, MediaKind
from tests.support.media_factory import image_bytes, video_frames

TOLERANCE = {"float64": dict(rtol=0, atol=1e-10), "float32": dict(rtol=1e-4, atol=1e-5)}


@functools.lru_cache(maxsize=4)
def encoder(model_dir: str, dtype: str) -> VisionEncoder:
    return VisionEncoder(model_dir, dtype=dtype)


class CountingEncoder:
    """Wraps a VisionEncoder and counts forwards and items per forward."""

    def __init__(self, inner: VisionEncoder):
        self.inner = inner
        self.identity = inner.identity
        self.forward_sizes: list[int] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, prepared):
        self.forward_sizes.append(len(prepared))
        return self.inner.forward(prepared)


def random_mix(seed: int) -> list[MediaItem]:
    rng = random.Random(seed)
    items = [
        MediaItem(MediaKind.IMAGE, (image_bytes(rng.randint(28, 120), rng.randint(28, 120), seed * 100 + k),))
        for k in range(rng.randint(3, 7))
    ]
    video = MediaItem(MediaKind.VIDEO, tuple(video_frames(8, 112, 112, seed)), fps=2.0)  # 4 x 16 tokens
    items.insert(rng.randint(0, len(items)), video)
    return items


async def pooled(enc, items, config: BatchConfig, per_request: int = 1) -> list[torch.Tensor]:
    pool = EncoderPool(enc, PoolConfig(config, preprocess_workers=2, cache_bytes=0))
    try:
        planned = [enc.plan(item) for item in items]
        groups = [planned[i:i + per_request] for i in range(0, len(planned), per_request)]
        outs = await asyncio.gather(*[pool.encode(g) for g in groups])
        return [e.rows for out in outs for e in out]
    finally:
        await pool.close()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("seed", [1, 2])
def test_batched_equals_one_at_a_time(model_dir, dtype, seed):
    enc = CountingEncoder(encoder(model_dir, dtype))
    items = random_mix(seed)
    expected = [enc.inner.encode([item])[0].rows for item in items]
    video_tokens = next(e.shape[0] for e, i in zip(expected, items) if i.kind is MediaKind.VIDEO)
    # a budget below the video's tokens forces the split; concurrent requests share forwards
    config = BatchConfig(max_batch_tokens=max(video_tokens // 2, 8), batch_wait_ms=30)
    got = asyncio.run(pooled(enc, items, config, per_request=2))
    assert len(enc.forward_sizes) < sum(enc.forward_sizes)  # some forward packed several pieces
    assert sum(enc.forward_sizes) > len(items)  # the video went through in pieces
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **TOLERANCE[dtype])


def test_split_video_equals_whole_video(model_dir):
    enc = encoder(model_dir, "float64")
    item = MediaItem(MediaKind.VIDEO, tuple(video_frames(8, 56, 84, 9)), fps=2.0)
    prepared = enc.preprocess(enc.plan(item))
    assert prepared.layout[0] == 4 and prepared.num_tokens == 24  # 4 temporal patches x 6 tokens
    [(whole,)] = enc.forward([prepared])
    for budget, sizes in ((6, [6, 6, 6, 6]), (18, [18, 6]), (24, [24])):
        pieces = enc.split(prepared, budget, "tokens")
        assert [p.num_tokens for p in pieces] == sizes
        got = torch.cat([parts[0] for parts in enc.forward(pieces)])
        torch.testing.assert_close(got, whole, **TOLERANCE["float64"])


def test_same_image_in_concurrent_requests_runs_the_vit_once(model_dir):
    enc = CountingEncoder(encoder(model_dir, "float64"))
    image = enc.plan(MediaItem(MediaKind.IMAGE, (image_bytes(64, 96, 77),)))

    async def body():
        pool = EncoderPool(enc, PoolConfig(BatchConfig(batch_wait_ms=5), cache_bytes=1 << 24))
        try:
            outs = await asyncio.gather(*[pool.encode([image]) for _ in range(8)])
            again = await pool.encode([image, image])
            return outs, again, pool.stats()
        finally:
            await pool.close()

    outs, again, stats = asyncio.run(body())
    assert enc.forward_sizes == [1]
    assert stats.dedup_hits + stats.cache_hits == 9 and stats.cache_hits >= 1
    assert all(torch.equal(o[0].rows, outs[0][0].rows) for o in outs)
    assert torch.equal(again[1].rows, outs[0][0].rows) and again[1].key == enc.identity.key(image.item)


def test_cache_key_changes_with_weights_preprocessing_and_dtype(model_dir):
    import dataclasses

    enc = encoder(model_dir, "float64")
    item = MediaItem(MediaKind.IMAGE, (image_bytes(32, 32, 1),))
    base = enc.identity.key(item)
    assert base == encoder(model_dir, "float64").identity.key(item)
    assert base != encoder(model_dir, "float32").identity.key(item)
    for field in ("model_id", "weights_fingerprint", "preprocess_fingerprint"):
        assert dataclasses.replace(enc.identity, **{field: "x"}).key(item) != base
    assert enc.identity.key(MediaItem(MediaKind.IMAGE, (image_bytes(32, 32, 2),))) != base


def test_router_cost_equals_encoded_tokens(model_dir):
    enc = encoder(model_dir, "float64")
    for item in random_mix(3):
        planned = enc.plan(item)
        assert planned.cost == enc.preprocess(planned).num_tokens == enc.encode([planned])[0].num_rows
