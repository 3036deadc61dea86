"""The encoder pool inside a running Serve app: cross-request batching and autoscaling on queued tokens."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from mmserve.families import router_face
from mmserve.inputs.media import EncodeItem, MediaItem, MediaKind
from tests.support.media_factory import data_uri, image_bytes
from tests.support.reference import reference_generate
from tests.support.serve_fixtures import TEST_LIMITS

pytestmark = pytest.mark.serve
APP = "encoder_pool_test"
MAX_TOKENS = 6
POOL = {
    "batch_wait_ms": 400,  # wide enough that concurrent HTTP requests meet in one batch on a busy CI box
    "cache_bytes": 0,
    "autoscale": True,
    "min_replicas": 1,
    "max_replicas": 2,
    "target_queued_tokens_per_replica": 256,
    "upscale_delay_s": 0,
    "downscale_delay_s": 2,
    "look_back_period_s": 1.5,
    "metrics_interval_s": 0.5,
}


@pytest.fixture(scope="module")
def pool_app(serve_urls, tiny_models):
    from ray import serve

    from deployments.serve.app import build_app

    small = {"num_cpus": 0.1}
    args = {
        "model": tiny_models["qwen2_vl"], "dtype": "float64", "served_model_name": "pool",
        "router": small, "encoder": small, "llm": small, "limits": TEST_LIMITS, "encoder_pool": POOL,
    }
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    base = serve_urls["qwen2_vl"].rsplit("/", 1)[0]
    try:
        yield f"{base}/{APP}", serve.get_deployment_handle("Encoder", app_name=APP)
    finally:
        serve.delete(APP)


def encoder_replicas() -> dict[str, int]:
    from ray import serve

    return dict(serve.status().applications[APP].deployments["Encoder"].replica_states)


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; encoder replicas {encoder_replicas()}")


def test_concurrent_requests_share_vit_forwards_and_match_monolithic(pool_app, tiny_models):
    url, encoder = pool_app
    before = encoder.stats.remote().result()
    images = [image_bytes(56 + 14 * k, 70, 300 + k) for k in range(3)]

    def ask(data: bytes) -> list[int]:
        body = {"model": "pool", "max_tokens": MAX_TOKENS, "return_token_ids": True, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(data)}},
                                         {"type": "text", "text": "Describe this."}]}]}
        resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(len(images)) as ex:
        got = list(ex.map(ask, images))
    after = encoder.stats.remote().result()
    items = after["pieces_forwarded"] - before["pieces_forwarded"]
    forwards = after["forwards"] - before["forwards"]
    assert items == len(images) and forwards < items  # different requests' images shared a forward
    for data, tokens in zip(images, got):
        ref = [{"role": "user", "content": [{"type": "image", "bytes": data}, {"type": "text", "text": "Describe this."}]}]
        assert tokens == reference_generate(tiny_models["qwen2_vl"], ref, MAX_TOKENS)


def test_burst_scales_encoder_up_then_idle_scales_back_to_min(pool_app, tiny_models):
    _, encoder = pool_app
    assert encoder_replicas().get("RUNNING") == 1
    seeds = iter(range(10_000, 10**6))
    face = router_face(tiny_models["qwen2_vl"])

    def planned(item: MediaItem) -> EncodeItem:  # what the router sends: the item, its layout and cost
        expansion = face.expand(item, TEST_LIMITS["max_pixels_per_image"])
        return EncodeItem(item, expansion.layout, expansion.cost)

    def burst():
        # 24 calls x 4 distinct 224x224 images (64 tokens each): ~6k queued tokens >> 256 per replica
        calls = [[planned(MediaItem(MediaKind.IMAGE, (image_bytes(224, 224, next(seeds)),))) for _ in range(4)]
                 for _ in range(24)]
        return [encoder.encode.remote(items) for items in calls]

    stop = threading.Event()

    def keep_bursting():  # until the new replica runs: an idle pool would cancel it while it starts
        while not stop.is_set():
            for response in burst():
                response.result()

    with ThreadPoolExecutor(1) as ex:
        bursting = ex.submit(keep_bursting)
        try:
            wait_for(lambda: encoder_replicas().get("RUNNING") == 2, 180, "scale-up to a second encoder replica")
        finally:
            stop.set()
        bursting.result()
    wait_for(lambda: encoder_replicas() == {"RUNNING": 1}, 60, "scale-down to min_replicas when idle")
