"""Honest errors, sampling ranges, bounded encoder memory and the request parser, without Ray Serve.

Fuzzing (hypothesis) runs a fixed, small budget: the request parser and the media header reader /
decoder may only ever raise InvalidRequest.
"""

import asyncio
import functools
import io
import json
import threading
import time

import grpc
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image
from ray.serve import exceptions as serve_exceptions

from deployments.api import grpc_api, openai_api
from deployments.config import LimitArgs
from deployments.core.failures import classify
from deployments.core.generation import GenerationOptions, sampling_params
from deployments.serve.encoder import EncoderDeployment
from encoder_service.batching import BatchConfig
from encoder_service.pool import EncoderPool, PoolConfig
from encoder_service.rpc.result_store import ResultStore
from llm_service.sampling import new_generator
from mmserve.errors import InvalidRequest, Overloaded, RequestTooLarge
from mmserve.inputs.media import decode_image, read_image_size
from mmserve.rpc.vlm_client import request, user
from tests.support.core_fakes import FakeLLM, make_core
from tests.support.encoder_fakes import FakeEncoder, expected_output, fake_item
from tests.support.media_factory import png_claiming
from tests.support.sampling import SampleInput, sample

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


# -- one classification ---------------------------------------------------------------------------------
@pytest.mark.parametrize("error, status, code", [
    (InvalidRequest("bad image"), 400, grpc.StatusCode.INVALID_ARGUMENT),
    (RequestTooLarge("too big"), 413, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded("queue full"), 503, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (torch.OutOfMemoryError("CUDA out of memory"), 503, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (serve_exceptions.BackPressureError(num_queued_requests=9, max_queued_requests=8), 429,
     grpc.StatusCode.RESOURCE_EXHAUSTED),
    (ValueError("a bug"), 500, grpc.StatusCode.INTERNAL),
    (KeyError("a bug"), 500, grpc.StatusCode.INTERNAL),
])
def test_errors_are_classified_once_for_both_apis(error, status, code):
    failure = classify(error)
    assert (failure.http_status, failure.grpc_code) == (status, code)


class _Metrics:
    class _Counter:
        def __init__(self):
            self.count = 0

        def inc(self, *args, **kw):
            self.count += 1

    def __init__(self):
        self.failures = self._Counter()


class _FailingPool:
    def __init__(self, error):
        self.error = error

    async def encode(self, items):
        raise self.error


@pytest.mark.parametrize("error, expected", [
    (InvalidRequest("cannot decode image"), InvalidRequest),
    (Overloaded("queue full"), Overloaded),
    (torch.OutOfMemoryError("CUDA out of memory"), Overloaded),
    (RuntimeError("shape mismatch in the tower"), RuntimeError),  # a bug stays a bug (500), never a 400
])
def test_encoder_deployment_keeps_failures_honest(error, expected):
    cls = EncoderDeployment.func_or_class
    deployment = cls.__new__(cls)
    deployment.pool, deployment.metrics, deployment.publisher = _FailingPool(error), _Metrics(), None
    deployment.adapters = None  # no LoRA adapters listed (`multiplexed_adapters`)
    with pytest.raises(expected) as raised:
        asyncio.run(deployment.encode([fake_item(1, 2)]))
    assert not isinstance(raised.value, InvalidRequest) or expected is InvalidRequest
    assert deployment.metrics.failures.count == 1


# -- sampling ranges: one check for HTTP and gRPC -------------------------------------------------------
OUT_OF_RANGE = [
    ("seed", 2**64), ("seed", 2**63), ("seed", -(2**63) - 1), ("temperature", -0.1), ("temperature", 2.5),
    ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2**40),
    ("min_p", -0.1), ("min_p", 1.1), ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
    ("frequency_penalty", 2.5), ("presence_penalty", -3.0), ("max_tokens", 0), ("max_tokens", -5),
    ("logprobs", 21), ("logprobs", -1), ("stop", ("",)), ("stop", tuple("x" * 17)),
    ("stop_token_ids", (-1,)), ("stop_token_ids", (2**40,)),
]


@pytest.mark.parametrize("field, value", OUT_OF_RANGE)
def test_out_of_range_sampling_options_are_invalid(field, value):
    with pytest.raises(InvalidRequest) as e:
        GenerationOptions(**{field: value})
    assert ("top_logprobs" if field == "logprobs" else field.rstrip("s").split("_")[0]) in str(e.value)


@pytest.mark.parametrize("field, value", [(f, v) for f, v in OUT_OF_RANGE if f in ("seed", "temperature", "top_p", "top_k")])
def test_out_of_range_sampling_is_invalid_over_http_and_grpc(field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], field: value}
    text = json.dumps(body, allow_nan=True).encode()
    with pytest.raises(InvalidRequest, match=field):
        openai_api.options(openai_api.parse_body(text))
    if field == "top_k" or field == "seed" and not -(2**63) <= value < 2**63:
        return  # the protobuf field's type already excludes it (int32 / int64)
    with pytest.raises(InvalidRequest, match=field):
        grpc_api.options(request([user("hi")], **{field: value}))


finite = dict(allow_nan=False, allow_infinity=False)
options_in_range = st.builds(
    GenerationOptions,
    max_tokens=st.none() | st.integers(1, 4000),
    temperature=st.none() | st.floats(0, 2, **finite),
    top_p=st.none() | st.floats(0, 1, exclude_min=True, **finite),
    top_k=st.none() | st.integers(-1, 2**31 - 1),
    min_p=st.none() | st.floats(0, 1, **finite),
    repetition_penalty=st.none() | st.floats(0, 1e300, exclude_min=True, **finite),
    frequency_penalty=st.none() | st.floats(-2, 2, **finite),
    presence_penalty=st.none() | st.floats(-2, 2, **finite),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    logprobs=st.none() | st.integers(0, 20),
)


@settings(FUZZ, max_examples=60)
@given(options_in_range, st.integers(0, 2**32))
def test_sampling_never_crashes_on_options_that_pass(opts, logits_seed):
    from transformers import GenerationConfig

    params = sampling_params(opts, prompt_len=5, max_model_len=4096, defaults=GenerationConfig())
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(logits_seed), dtype=torch.float64) * 10
    inputs = [SampleInput(params, new_generator(params, torch.device("cpu")), [1, 2, 3], [4, 4]) for _ in range(2)]
    result = sample(logits, inputs)
    assert all(0 <= t < 50 for t in result.token_ids)


# -- the request parser -------------------------------------------------------------------------------
def test_content_part_errors_name_the_part_without_union_noise():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                      {"type": "image_url", "image_url": {}}]}]}
    with pytest.raises(InvalidRequest) as e:
        openai_api.parse_body(json.dumps(body).encode())
    assert str(e.value) == "invalid request: messages.0.content.1.image_url.url: Field required"


def test_request_body_over_the_limit_is_413(tiny_models):
    core = make_core(tiny_models["qwen2_vl"], limits=LimitArgs(max_request_bytes=2048))
    core.check_size(2048)
    with pytest.raises(RequestTooLarge):
        core.check_size(4096)
    assert classify(RequestTooLarge("x")).http_status == 413


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=8,
)
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "video", "x"])}, optional={
    "text": json_values, "image_url": st.fixed_dictionaries({"url": st.text(max_size=40) | json_values}),
    "video": st.lists(st.text(max_size=30), max_size=3), "fps": json_values,
})
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"])},
                                optional={"content": st.text(max_size=20) | st.lists(part, max_size=3) | json_values})
chat_body = st.fixed_dictionaries({"messages": st.lists(message, max_size=3)}, optional={
    k: json_values for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
                             "logprobs", "top_logprobs", "stop_token_ids", "repetition_penalty", "stream")
})


@functools.lru_cache(maxsize=1)
def _fuzz_core(model_dir: str):
    return make_core(model_dir, limits=LimitArgs(max_items_per_request=4))


def _parse_all_the_way(model_dir: str, raw: bytes) -> None:
    """The whole request path (parse, check, load media, plan, sample) to a fake LLM."""

    async def read():
        return openai_api.chat_request(openai_api.parse_body(raw))

    try:
        asyncio.run(_fuzz_core(model_dir).generate(None, read, "fuzz"))
    except InvalidRequest:
        pass


@settings(FUZZ, max_examples=80)
@given(body=chat_body)
def test_fuzzed_requests_raise_only_invalid_request(tiny_models, body):
    _parse_all_the_way(tiny_models["qwen2_vl"], json.dumps(body).encode())


@FUZZ
@given(raw=st.binary(max_size=200))
def test_fuzzed_bytes_raise_only_invalid_request(tiny_models, raw):
    _parse_all_the_way(tiny_models["qwen2_vl"], raw)


# -- the media header reader and decoder ---------------------------------------------------------------
def _encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (24, 16), (10, 200, 30)).save(buf, fmt)
    return buf.getvalue()


SEEDS = {fmt: _encoded(fmt) for fmt in ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "ICO", "TGA", "PPM")}


@st.composite
def mutated_images(draw):
    data = bytearray(SEEDS[draw(st.sampled_from(sorted(SEEDS)))])
    for _ in range(draw(st.integers(0, 6))):
        data[draw(st.integers(0, min(len(data), 80) - 1))] = draw(st.integers(0, 255))  # mostly headers
    return bytes(data[: draw(st.integers(0, len(data)))])


def _tiff_with_a_bad_tag() -> bytes:
    """Two header bytes changed and the tail cut: Pillow's decoder raises TypeError (found by fuzzing)."""
    data = bytearray(SEEDS["TIFF"][:197])
    data[60], data[72] = 4, 2
    return bytes(data)


@FUZZ
@example(_tiff_with_a_bad_tag())
@given(mutated_images() | st.binary(max_size=64))
def test_fuzzed_media_raise_only_invalid_request(data):
    try:
        read_image_size(data, max_pixels=1_000_000)
    except InvalidRequest:
        return
    try:
        decode_image(data)
    except InvalidRequest:
        pass


def test_huge_header_and_empty_image_are_invalid():
    for max_pixels in (40_000_000, 10**12):  # ours, then Pillow's own bomb check
        with pytest.raises(InvalidRequest, match="exceeds the limit"):
            read_image_size(png_claiming(30000, 30000), max_pixels=max_pixels)
    with pytest.raises(InvalidRequest, match="not a recognised image format"):
        read_image_size(b"", max_pixels=40_000_000)


# -- bounded memory --------------------------------------------------------------------------------------
def test_encoder_pixel_queue_is_capped_and_recovers():
    item_bytes = 4 * 10 * 8  # FakeEncoder: 4 rows of float64 per token, 10 tokens
    config = PoolConfig(BatchConfig(1000, max_batch_items=1, batch_wait_ms=0), preprocess_workers=4, cache_bytes=0,
                        max_queued_bytes=2 * item_bytes)
    encoder = FakeEncoder(forward_s=0.05)

    async def body():
        pool = EncoderPool(encoder, config)
        try:
            results = await asyncio.gather(*(pool.encode([fake_item(i, 10)]) for i in range(8)),
                                           return_exceptions=True)
            refused = [r for r in results if isinstance(r, Overloaded)]
            served = [(i, r[0]) for i, r in enumerate(results) if not isinstance(r, BaseException)]
            assert refused and served and len(refused) + len(served) == 8
            assert all(torch.equal(out.rows, expected_output(i, 10)) for i, out in served)
            assert pool.stats().queued_bytes == 0 and pool.stats().refused_overloaded == len(refused)
            [again] = await pool.encode([fake_item(100, 10)])  # nothing leaked: a later item runs
            assert torch.equal(again.rows, expected_output(100, 10))
        finally:
            await pool.close()

    asyncio.run(body())


def test_result_store_is_capped_and_recovers():
    store = ResultStore(ttl_s=60, max_bytes=100)
    store.put("a", torch.zeros(8, dtype=torch.float64))  # 64 bytes
    with pytest.raises(Overloaded, match="full"):
        store.put("b", torch.zeros(8, dtype=torch.float64))
    store.put("a", torch.zeros(8, dtype=torch.float64))  # another pin of a held entry takes no room
    for _ in range(2):
        store.acquire("a")
        store.finish("a", delivered=True)
    assert store.num_bytes == 0
    store.put("b", torch.zeros(8, dtype=torch.float64))
    store.finish("b", delivered=True) if store.acquire("b") is not None else None
    store.put("huge", torch.zeros(100, dtype=torch.float64))  # alone, anything fits
    assert "huge" in store


def test_fetch_waits_on_an_event_not_a_poll():
    store = ResultStore(ttl_s=60)

    async def body():
        start = time.monotonic()
        assert await store.wait_acquire("missing", 0.1) is None
        waited = time.monotonic() - start
        threading.Timer(0.05, store.put, ("h", torch.ones(3))).start()
        start = time.monotonic()
        tensor = await store.wait_acquire("h", 10)
        return waited, time.monotonic() - start, tensor

    waited, woke_after, tensor = asyncio.run(body())
    assert 0.1 <= waited < 1 and woke_after < 1 and torch.equal(tensor, torch.ones(3))
    assert not store._waiters  # no waiter left behind


# -- request ids ----------------------------------------------------------------------------------------
def test_grpc_engine_key_is_ours_and_the_client_id_is_echoed(tiny_models):
    from deployments.api.grpc_api import GrpcAdapter
    from tests.unit.test_grpc_api import _Context

    llm = FakeLLM()
    adapter = GrpcAdapter(make_core(tiny_models["qwen2_vl"], llm, api_key="k3y"))
    for _ in range(2):
        ctx = _Context((("authorization", "Bearer k3y"),))
        reply = asyncio.run(adapter.generate(request([user("hi")], request_id="same", max_tokens=2), ctx))
        assert reply.request_id == "same" and ("x-request-id", "same") in ctx.trailing
    seen = [pending.request_id for pending in llm.calls]
    assert len(set(seen)) == 2 and "same" not in seen and all(len(s) == 32 for s in seen)
