"""The Router's body deadline (`limits.body_timeout_s`, `openai_api.read_body`): a body that has not all
arrived in time is refused (400, naming the setting) and frees the Router's place, whatever its size;
one that comes in time is read whole. (In front, `mmserve serve`'s request cap holds a body's first
16 KiB to its own 10 s: tests/unit/test_header_cap.py.)"""

from __future__ import annotations

import asyncio

import pytest

from deployments.api.openai_api import read_body
from deployments.config import LimitArgs
from mmserve.errors import InvalidRequest


class _Trickled:
    """A Starlette request whose body comes `chunk` by `chunk`, `every_s` apart."""

    def __init__(self, chunks: list[bytes], every_s: float):
        self.headers = {"content-length": str(sum(map(len, chunks)))}
        self.chunks, self.every_s = chunks, every_s

    async def stream(self):
        for chunk in self.chunks:
            await asyncio.sleep(self.every_s)
            yield chunk


def _no_limit(size: int) -> None:
    pass


def test_a_body_that_does_not_arrive_in_time_is_refused_naming_the_setting():
    slow = _Trickled([b"{"] * 50, every_s=0.05)  # 2.5 s in all
    with pytest.raises(InvalidRequest, match=r"did not arrive within 0.5 s \(\d+ bytes came; limits.body_timeout_s\)"):
        asyncio.run(read_body(slow, _no_limit, timeout_s=0.5))


def test_a_body_in_time_is_read_whole_and_the_default_is_30_s():
    assert asyncio.run(read_body(_Trickled([b"ab", b"cd"], every_s=0.01), _no_limit, timeout_s=5)) == b"abcd"
    assert LimitArgs().body_timeout_s == 30
