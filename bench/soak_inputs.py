"""The soak's requests: good ones (greedy, text and 1–2 images of varied sizes, streaming or not)
and bad inputs of many kinds, each of which must get a 4xx naming the problem."""

from __future__ import annotations

import base64
import json
import random
from dataclasses import dataclass

from tests.support.media_factory import data_uri, image_bytes

MAX_TOKENS = 40  # long enough that a stream can be caught with >= 2 tokens sent and >= 8 left
SIZES = [(64, 64), (120, 160), (224, 224), (300, 200), (480, 360), (640, 480)]
TOPICS = ["the weather", "a red bicycle", "three cats", "the harbour at night", "a chess game", "an old map"]


@dataclass(frozen=True)
class SoakRequest:
    index: int
    good: bool
    stream: bool
    body: dict | None  # None: send `raw` as the body
    raw: bytes | None = None
    kind: str = "good"  # for bad inputs: what is wrong with it
    images: int = 0


def _image_part(rng: random.Random, seed: int, sizes=SIZES) -> dict:
    h, w = rng.choice(sizes)
    return {"type": "image_url", "image_url": {"url": data_uri(image_bytes(h, w, seed=seed))}}


def good_request(index: int, rng: random.Random, light: bool = False) -> SoakRequest:
    """A greedy request; `light` ones (the unloaded and burst phases) have at most one small image."""
    images = rng.choice([0, 1]) if light else rng.choices([0, 1, 2], weights=[4, 4, 2])[0]
    sizes = SIZES[:3] if light else SIZES
    content = [_image_part(rng, 1000 * index + j, sizes) for j in range(images)]
    content.append({"type": "text", "text": f"request {index}: tell me about {rng.choice(TOPICS)}"})
    stream = rng.random() < 0.7
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream, "return_token_ids": True}
    return SoakRequest(index, True, stream, body, images=images)


def _chat(content, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}


def _url(url: str) -> dict:
    return _chat([{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}])


def bad_inputs() -> list[tuple[str, dict | None, bytes | None]]:
    """(kind, body, raw body) of every kind of bad input the soak sends."""
    png = image_bytes(32, 32, seed=1)
    tiny = {"type": "image_url", "image_url": {"url": data_uri(image_bytes(8, 8, seed=2))}}
    return [
        ("invalid JSON", None, b'{"messages": [oops'),
        ("not an image", _url("data:image/png;base64," + base64.b64encode(b"hello, world").decode()), None),
        ("truncated PNG", _url(data_uri(png[: len(png) // 2])), None),
        ("file URL", _url("file:///etc/passwd"), None),
        ("local path", _url("/etc/passwd"), None),
        ("ftp URL", _url("ftp://example.com/cat.png"), None),
        ("gopher URL", _url("gopher://example.com/1"), None),
        ("loopback http URL", _url("http://127.0.0.1:8265/"), None),
        ("too many images", _chat([tiny] * 40 + [{"type": "text", "text": "many"}]), None),
        ("unknown model", {**_chat("hi"), "model": "no-such-model"}, None),
        ("temperature -1", _chat("hi", temperature=-1), None),
        ("seed 2**64", _chat("hi", seed=2**64), None),
        ("max_tokens over context", _chat("hi", max_tokens=10**7), None),
        ("unknown content part", _chat([{"type": "audio_url", "audio_url": {"url": "x"}}]), None),
        ("no messages", {"messages": [], "max_tokens": 4}, None),
        ("n = 2", _chat("hi", n=2), None),
        ("bad base64", _url("data:image/png;base64,!!!not-base64!!!"), None),
        ("top_p 0", _chat("hi", top_p=0), None),
    ]


def soak_requests(count: int, bad_share: float, seed: int) -> list[SoakRequest]:
    rng = random.Random(seed)
    bad = bad_inputs()
    requests = []
    for i in range(count):
        if rng.random() < bad_share:
            kind, body, raw = bad[i % len(bad)]
            requests.append(SoakRequest(i, False, False, body, raw, kind))
        else:
            requests.append(good_request(i, rng))
    return requests


def encode(request: SoakRequest) -> bytes:
    return request.raw if request.body is None else json.dumps(request.body).encode()
