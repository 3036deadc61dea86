"""Video streamed through the pipeline, without Ray: a server-decoded video's frame groups, encoded
one by one as they are decoded, give the whole video's embedding rows bit for bit, for every
family with video; the decoder hands the groups out in decode order."""

import asyncio

import numpy as np
import pytest
import torch

from mmserve.families import router_face
from mmserve.inputs.media import MediaItem, MediaKind
from mmserve.video.container import FrameSampler, VideoLimits
from mmserve.video.workers import VideoDecodePool
from tests.support.media_factory import video_file
from tests.unit.test_video_url import video_models  # noqa: F401  (fixture)

pytest.importorskip("av")

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "minicpmv4_6"]


def _groups(pool: VideoDecodePool, data: bytes, size: int) -> list[np.ndarray]:
    async def collect():
        return [g async for g in pool.frames(data, "test", size)]

    return asyncio.run(collect())


@pytest.mark.parametrize("frames", [1, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_frame_groups_encode_to_the_whole_video_rows(video_models, family, frames):  # noqa: F811
    from encoder_service import VisionEncoder

    model_dir = video_models[family]
    data = video_file(6.4, 10, 56, 84, seed=31)  # 13 frames at 2 fps: a padded last temporal patch for Qwen
    pool = VideoDecodePool(FrameSampler(model_dir), VideoLimits(), workers=1)
    try:
        header = asyncio.run(pool.probe(data, "test"))
        whole = MediaItem(MediaKind.VIDEO, (), decoded=asyncio.run(pool.decode(data, "test")))
        face = router_face(model_dir)
        [expansion] = face.expand_all([whole], 1 << 24)
        groups = face.stream_groups(whole, expansion.layout, frames)
        assert sum(g.frames for g in groups) == header.shape[0] == whole.num_frames and len(groups) > 1
        decoded = _groups(pool, data, groups[0].frames)
    finally:
        pool.close()
    assert [len(d) for d in decoded] == [g.frames for g in groups]
    assert np.array_equal(np.concatenate(decoded), whole.decoded.pixels)
    assert header.pixels is None and header.shape == whole.decoded.shape and header.indices == whole.decoded.indices
    encoder = VisionEncoder(model_dir, dtype="float64")
    prepared = encoder.face.preprocess(whole, expansion.layout)
    [expected] = encoder.forward([prepared])
    first, pixels, rows = 0, [], []
    for group, frames in zip(groups, decoded):
        item = MediaItem(MediaKind.VIDEO, (), decoded=header.group(first, frames))
        piece = encoder.face.preprocess(item, group.layout)
        assert piece.num_tokens == group.cost
        pixels.append(piece.tensors[0])
        rows.append(encoder.forward([piece])[0])
        first += group.frames
    packed = -1 if family == "minicpmv4_6" else 0  # MiniCPM-V packs views side by side, Qwen patches in rows
    assert torch.equal(torch.cat(pixels, dim=packed), prepared.tensors[0])  # bit for bit
    for k, part in enumerate(expected):  # a forward over fewer rows sums in another order: float64 rounding
        torch.testing.assert_close(torch.cat([r[k] for r in rows]), part, rtol=1e-12, atol=1e-12)


# -- the LLM side: VideoStream + the engine, step by step -------------------------------------------
class Streamed:
    """One video request planned from the decoder's header (as the router plans a streamed video),
    fed to a step-driven engine by a `VideoStream` over a real decoder pool and encoder."""

    def __init__(self, model_dir: str, data: bytes, header, pool: VideoDecodePool, frames=None):
        from deployments.core.llm_inputs import StreamedVideo
        from llm_service.engine.llm_engine import LLMRequest
        from llm_service.sampling import SamplingParams
        from mmserve.request.prompt_plan import Message
        from tests.support.engine_support import make_engine
        from tests.support.pipeline import runtimes

        planner, self.encoder, _ = runtimes(model_dir)
        item = MediaItem(MediaKind.VIDEO, (data,), decoded=header)
        plan = planner.plan([Message("user", (item, "What happens?"))])
        [media] = plan.media
        self.video = StreamedVideo(data, header, tuple(planner.face.stream_groups(item, media.layout)))
        self.plan, self.pool, self.frames = plan, pool, frames or pool.frames
        self.engine = make_engine(model_dir, max_num_batched_tokens=32)
        self.request = lambda rid, media: LLMRequest(rid, tuple(plan.token_ids), SamplingParams(max_tokens=6),
                                                     plan.positions, media)
        self.events = {}

    async def encode(self, item):
        return (await asyncio.to_thread(self.encoder.encode, [item]))[0]

    def start(self, rid: str):
        from deployments.core.video_stream import VideoStream

        return VideoStream(rid, self.plan.ranges, {0: self.video}, self.frames, self.encode)

    def add(self, rid: str, embedding, ready=None):
        self.events[rid] = []
        self.engine.add_request(self.request(rid, ((self.plan.ranges[0], embedding),)), self.events[rid].append, ready)

    def tokens(self, rid: str) -> list[int]:
        return [e.token_id for e in self.events[rid] if e.token_id is not None]

    async def drive(self, until) -> None:
        for _ in range(5000):
            if until():
                return
            self.engine.step()
            await asyncio.sleep(0.002)
        raise AssertionError("no progress")


def _held_back_last_group(pool: VideoDecodePool, release: asyncio.Event):
    """The real decoder's groups, the last one held until `release` (to see prefill go ahead of it)."""
    async def frames(data, request_id, size, indices):
        groups = [g async for g in pool.frames(data, request_id, size, indices)]
        for group in groups[:-1]:
            yield group
        await release.wait()
        yield groups[-1]

    return frames


def test_prefill_runs_behind_the_decoder_and_gives_the_unstreamed_tokens(tiny_models):
    model_dir = tiny_models["qwen2_5_vl"]
    data = video_file(3.4, 10, 56, 84, seed=32)
    pool = VideoDecodePool(FrameSampler(model_dir), VideoLimits(), workers=1)

    async def scenario():
        release = asyncio.Event()
        s = Streamed(model_dir, data, await pool.probe(data, "plan"), pool, _held_back_last_group(pool, release))
        stream = s.start("streamed")
        [embedding] = (await stream.start()).values()
        s.add("streamed", embedding, stream.ready())
        stream.on_progress = lambda ready: s.engine.extend("streamed", ready)
        stream.on_progress(stream.ready())
        seq = lambda: s.engine._by_id.get("streamed")  # noqa: E731
        await s.drive(lambda: stream.groups_in == len(s.video.groups) - 1 and seq() and not seq().runnable)
        computed_before_last = seq().num_computed
        assert not s.engine.scheduler.has_work()  # nothing to run: the engine waits instead of spinning
        assert s.engine.health(0.0) is None  # ...and is not stalled
        release.set()
        await stream.task
        await s.drive(lambda: s.events["streamed"] and s.events["streamed"][-1].finish_reason)
        whole = MediaItem(MediaKind.VIDEO, (), decoded=await pool.decode(data, "whole"))
        [full] = s.encoder.encode([type(s.plan.media[0])(whole, s.plan.media[0].layout, s.plan.media[0].cost)])
        s.add("whole", full)
        await s.drive(lambda: s.events["whole"] and s.events["whole"][-1].finish_reason)
        return s, computed_before_last

    try:
        s, computed_before_last = asyncio.run(scenario())
    finally:
        pool.close()
    video_start = s.plan.ranges[0].offset
    last_group_at = video_start + s.plan.ranges[0].embed_slots()[-s.video.groups[-1].cost]
    assert video_start < computed_before_last <= last_group_at  # text and early groups prefilled before the last
    assert s.tokens("streamed") == s.tokens("whole") and len(s.tokens("whole")) >= 1
    assert s.engine.scheduler.blocks.num_used_blocks == 0


@pytest.mark.parametrize("fault", ["decode error at group 2", "client cancel"])
def test_a_fault_mid_stream_leaves_no_blocks_and_no_busy_decoder(tiny_models, fault):
    from mmserve.errors import InvalidRequest

    model_dir = tiny_models["qwen2_vl"]
    data = video_file(3.4, 10, 56, 84, seed=33)
    pool = VideoDecodePool(FrameSampler(model_dir), VideoLimits(), workers=1)
    admitted, release = asyncio.Event(), asyncio.Event()

    async def failing(data, request_id, size, indices):  # the real decoder's groups, then a fault at group 2
        k = 0
        async for group in pool.frames(data, request_id, size, indices):
            if k == 2:
                await admitted.wait()  # once the request is in the engine, prefilling
                if fault.startswith("decode"):
                    raise InvalidRequest("cannot decode video (h264) at frame 5: Invalid data")
                await release.wait()  # a client cancel comes while the decoder is mid-video
            yield group
            k += 1

    async def scenario():
        s = Streamed(model_dir, data, await pool.probe(data, "plan"), pool, failing)
        stream = s.start("r")
        [embedding] = (await stream.start()).values()
        s.add("r", embedding, stream.ready())
        stream.on_progress = lambda ready: s.engine.extend("r", ready)
        await s.drive(lambda: s.engine.scheduler.blocks.num_used_blocks > 0 and stream.groups_in >= 2)
        admitted.set()
        if fault == "client cancel":
            stream.cancel()
        with pytest.raises((InvalidRequest, asyncio.CancelledError)):
            await stream.task
        s.engine.abort("r")  # what the LLM replica does when its stream ends early
        await s.drive(lambda: s.events["r"] and s.events["r"][-1].finish_reason)
        await asyncio.sleep(0.05)
        return s

    try:
        s = asyncio.run(scenario())
        assert s.events["r"][-1].finish_reason == "abort"
        assert s.engine.scheduler.blocks.num_used_blocks == 0 and not s.engine.scheduler.running and not s.engine.scheduler.waiting
        assert not pool._running and pool.waiting == 0  # the decoder's worker is not held by the dead stream
        assert len(asyncio.run(pool.decode(data, "next")).indices) > 0  # and it decodes the next video
    finally:
        pool.close()


def test_a_group_whose_encoder_is_lost_is_encoded_again(tiny_models):
    from mmserve.errors import EmbeddingsLost

    model_dir = tiny_models["qwen2_vl"]
    data = video_file(3.4, 10, 56, 84, seed=34)
    pool = VideoDecodePool(FrameSampler(model_dir), VideoLimits(), workers=1)
    lost = []

    async def scenario():
        s = Streamed(model_dir, data, await pool.probe(data, "plan"), pool)
        encode = s.encode

        async def flaky(item):  # group 1's first encoder dies with it
            if item.item.decoded.content_hash.endswith("#2") and not lost:
                lost.append(item)
                raise EmbeddingsLost((0,))
            return await encode(item)

        s.encode = flaky
        stream = s.start("r")
        [embedding] = (await stream.start()).values()
        s.add("r", embedding, stream.ready())
        stream.on_progress = lambda ready: s.engine.extend("r", ready)
        await stream.task
        s.engine.extend("r", stream.ready())
        await s.drive(lambda: s.events["r"] and s.events["r"][-1].finish_reason)
        whole = MediaItem(MediaKind.VIDEO, (), decoded=await pool.decode(data, "whole"))
        media = s.plan.media[0]
        [full] = s.encoder.encode([type(media)(whole, media.layout, media.cost)])
        s.add("whole", full)
        await s.drive(lambda: s.events["whole"] and s.events["whole"][-1].finish_reason)
        return s

    try:
        s = asyncio.run(scenario())
    finally:
        pool.close()
    assert len(lost) == 1 and s.tokens("r") == s.tokens("whole")
    assert s.engine.scheduler.blocks.num_used_blocks == 0


def test_a_first_group_lost_every_time_fails_the_stream_with_its_item(tiny_models):
    """Group 0's encoders all die while group 1 is in and waits for group 0's buffer: the stream
    fails with `EmbeddingsLost` naming the request's item (the router then streams the video again),
    after ENCODE_TRIES tries; it does not hand out embeddings without that item."""
    from deployments.core.video_stream import ENCODE_TRIES
    from mmserve.errors import EmbeddingsLost

    model_dir = tiny_models["qwen2_vl"]
    data = video_file(3.4, 10, 56, 84, seed=35)
    pool = VideoDecodePool(FrameSampler(model_dir), VideoLimits(), workers=1)
    tries, reencodes, later = [], [], []

    async def scenario():
        s = Streamed(model_dir, data, await pool.probe(data, "plan"), pool)
        encode = s.encode

        async def lost_first(item):
            if item.item.decoded.content_hash.endswith("#0"):
                tries.append(item)
                await asyncio.sleep(0.3)  # the later groups are in meanwhile
                raise EmbeddingsLost((7,))  # as `resolve` names it: its own position, not the request's
            later.append(await encode(item))
            return later[-1]

        s.encode = lost_first
        stream = s.start("r")
        stream.on_reencode = lambda: reencodes.append(1)
        with pytest.raises(EmbeddingsLost) as lost:
            await stream.start()
        return stream, lost.value

    try:
        stream, error = asyncio.run(scenario())
    finally:
        pool.close()
    assert len(tries) == ENCODE_TRIES and len(reencodes) == ENCODE_TRIES - 1
    assert error.items == (0,) and later and stream.groups_in == 0  # later groups encoded, waiting for group 0's
