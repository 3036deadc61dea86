"""A request's videos streamed through the pipeline on the LLM replica, without Ray.

For each `StreamedVideo` of a request, `VideoStream` reads the frame groups the decoder sends as it
decodes them, sends each group to be encoded at once (groups encode concurrently and out of
order), and copies each group's rows into the item's embedding, allocated when its first group is
in. `ready()` is how far the prompt's inputs are present: up to the first embedding slot whose row
has not arrived, in prompt order. The LLM replica admits the request to the engine with that bound
and moves it (`LLMEngine.extend`) as groups arrive, so prefill runs behind the decoder.

A group whose encoder replica is lost (`EmbeddingsLost`) is encoded again, up to
`ENCODE_TRIES` times in all; past that the stream fails with `EmbeddingsLost` naming the request's
item, and the router's failover sends the request again (the video is streamed again). A failure anywhere else (a decode error at a later frame, a group the
encoder refuses) ends the stream with that error; the caller aborts the engine
request, so nothing stays held.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence

import numpy as np
import torch

from deployments.core.llm_inputs import StreamedVideo
from mmserve.errors import EmbeddingsLost
from mmserve.inputs.embeddings import ItemEmbedding
from mmserve.inputs.media import EncodeItem, MediaItem, MediaKind, PlaceholderRange

logger = logging.getLogger("ray.serve")
ENCODE_TRIES = 3  # a group whose encoder replica is lost is encoded again, twice at most

# (file, request id, group size, the header's sampled indices) -> groups
Frames = Callable[[bytes, str, int, tuple[int, ...]], AsyncIterator[np.ndarray]]
Encode = Callable[[EncodeItem], Awaitable[ItemEmbedding]]


class VideoStream:
    def __init__(self, request_id: str, ranges: Sequence[PlaceholderRange], videos: Mapping[int, StreamedVideo],
                 frames: Frames, encode: Encode):
        self.request_id = request_id
        self.ranges = ranges
        self.videos = dict(sorted(videos.items()))
        self._frames, self._encode = frames, encode
        self.embeddings: dict[int, ItemEmbedding] = {}
        self._filled = {i: [False] * len(v.groups) for i, v in self.videos.items()}
        self._first = {i: asyncio.get_running_loop().create_future() for i in self.videos}
        self.task: asyncio.Task | None = None  # every video's, from `start`
        self.on_progress: Callable[[int | None], None] = lambda ready: None
        self.on_reencode: Callable[[], None] = lambda: None  # a group's encoder replica was lost
        self.groups_in = 0  # groups whose rows are in (all items)

    async def start(self) -> dict[int, ItemEmbedding]:
        """Start every video; each item's embedding (rows still being filled) once its first group
        is in. Raises the stream's failure if it comes first."""
        self.task = asyncio.ensure_future(self._run())
        waiting = asyncio.ensure_future(asyncio.gather(*self._first.values()))
        waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # a cancelled wait is no error
        await asyncio.wait([self.task, waiting], return_when=asyncio.FIRST_COMPLETED)
        if self.task.done():  # all in, or failed (first groups in or not), or cancelled
            waiting.cancel()
            if self.task.cancelled() or self.task.exception() is not None:
                self.task.result()  # raises
        return dict(self.embeddings)

    def ready(self) -> int | None:
        """Prompt tokens whose inputs are present (None: all of them)."""
        for i, video in self.videos.items():
            rows = 0
            for group, filled in zip(video.groups, self._filled[i]):
                if not filled:
                    return self.ranges[i].offset + self.ranges[i].embed_slots()[rows]
                rows += group.cost
        return None

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        await asyncio.gather(*(self._item(i, video) for i, video in self.videos.items()))

    async def _item(self, index: int, video: StreamedVideo) -> None:
        tasks: list[asyncio.Task] = []
        first, row = 0, 0
        try:
            async with contextlib.aclosing(self._frames(video.data, self.request_id, video.groups[0].frames,
                                                     video.header.indices)) as groups:
                async for pixels in groups:
                    k = len(tasks)
                    if k >= len(video.groups) or len(pixels) != video.groups[k].frames:
                        raise RuntimeError(f"the decoder sent {len(pixels)} frames as group {k} of a video planned "
                                           f"as {[g.frames for g in video.groups]}")
                    group = video.groups[k]
                    item = MediaItem(MediaKind.VIDEO, (), decoded=video.header.group(first, pixels),
                                     tower_adapter=video.tower_adapter)
                    encode = EncodeItem(item, group.layout, group.cost)
                    tasks.append(asyncio.ensure_future(self._group(index, k, row, encode)))
                    first, row = first + group.frames, row + group.cost
            if len(tasks) != len(video.groups):
                raise RuntimeError(f"the decoder sent {len(tasks)} of the video's {len(video.groups)} frame groups")
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _group(self, index: int, k: int, row: int, item: EncodeItem) -> None:
        for attempt in range(ENCODE_TRIES):
            try:
                embedding = await self._encode(item)
                break
            except EmbeddingsLost:  # its encoder replica died: encode the group again, as the router would
                if attempt == ENCODE_TRIES - 1:  # the router streams the whole video again
                    raise EmbeddingsLost((index,), f"the encoders of video frame group {k} were lost "
                                                   f"{ENCODE_TRIES} times") from None
                logger.warning("request %s: the encoder of video frame group %d was lost; encoding it again",
                               self.request_id, k)
                self.on_reencode()
        if embedding.num_rows != item.cost:
            raise RuntimeError(f"group {k} of a video encoded to {embedding.num_rows} rows, planned {item.cost}")
        first = self._first[index]
        if k == 0:
            total = sum(g.cost for g in self.videos[index].groups)
            parts = tuple(torch.empty((total, *p.shape[1:]), dtype=p.dtype) for p in embedding.parts)
            self.embeddings[index] = ItemEmbedding(parts, f"streamed:{embedding.key}")
            first.set_result(None)
        else:  # shielded: this group cancelled (the stream failed) must not cancel the others' wait
            await asyncio.shield(first)
        for buffer, part in zip(self.embeddings[index].parts, embedding.parts, strict=True):
            buffer[row:row + item.cost] = part
        self._filled[index][k] = True
        self.groups_in += 1
        self.on_progress(self.ready())
