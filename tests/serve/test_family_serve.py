"""Each family's tiny checkpoint through the Serve app == `transformers` monolithic `generate`
(float64): the `openai` client (streaming == non-streaming) on every embedding transport the family
is served with, and the public gRPC API (unary and streamed); a video file (`video_url`) decoded and
sampled on the server by the family's own rule, streamed through the pipeline or decoded whole. The
cases are the family's own (tests/support/cases.py). (The Qwen2-VL families: test_serve_app.py,
test_grpc_serve.py, test_video_url_serve.py.)

One app per family, and a second one with `transport: grpc` for Qwen3-VL only: the transport moves
an item's output parts (`ItemEmbedding`: dtype, shape, bytes) whatever the family, and what varies
between families is their number: Qwen3-VL's (and its MoE sibling's, the same encoder face) are one
part per DeepStack layer beside the merged rows, every other family's one part, the Qwen2-VL
families' test (`secured_url`, test_serve_app.py) covers. Sub-items (MiniCPM-V's slices, Step3's
crops) are joined in the encoder pool before an item leaves it. A video file is streamed when it
samples to the app's `stream_min_frames` or more and decoded whole below, so one app covers both.

Qwen3-VL's gRPC app serves the family's block-FP8 checkpoint (Qwen's `-FP8` layout), so its tokens
are those of that checkpoint dequantized (`tests/support/quantized_reference.py`): the quantized
linears served over HTTP and the public gRPC API at no extra deployment."""

from __future__ import annotations

import dataclasses

import pytest

from mmserve.rpc.vlm_client import VLMClient
from tests.support.cases import CASE_TOKENS, family_cases, openai_chat, proto_messages, shared_prefix_sequence
from tests.support.reference import reference_generate
from tests.support.serve_fixtures import _app_args

pytestmark = pytest.mark.serve


def video(stream_min_frames: int) -> dict:
    """An app's `video_decode`: a video sampling to `stream_min_frames` frames or more is streamed, a
    shorter one decoded whole."""
    return {"video_decode": {"stream_group_frames": 2, "stream_min_frames": stream_min_frames}}


# The test's 3.4 s video streams and its 0.6 s one does not: Qwen3-VL's processor samples them to 6 and
# 4 frames (its minimum), MiniCPM-V's to 4 and fewer.
VIDEO, MINICPM_VIDEO = video(5), video(4)
GRPC = {"transport": "grpc", "video_decode": {"stream": False}}  # embeddings over gRPC, a video decoded whole


@dataclasses.dataclass(frozen=True)
class Served:
    apps: dict[str, dict]  # app name -> its extra AppArgs; the first moves embeddings through Ray's object store
    cases: tuple[str, ...]  # sent over HTTP to every app (text only: to the first; it crosses no transport)
    grpc_api: tuple[str, ...] = ()  # also sent over the public gRPC API (it carries a message's media before its text)
    grpc_app: str = ""  # the app the gRPC API calls go to
    video_seed: int | None = None  # a video file sent as `video_url` (the family takes videos)
    quantized: dict[str, str] = dataclasses.field(default_factory=dict)  # app name -> the format of its checkpoint


SERVED = {
    "llava": Served({"llava": {}}, ("one_image", "three_images"), ("one_image",), "llava"),
    "llava_siglip": Served({"llava_siglip": {}}, ("one_image", "three_images"), ("one_image",), "llava_siglip"),
    "step3p7": Served({"step3p7": {}}, ("text_only", "one_image", "three_images", "long_prompt"), ("one_image",),
                      "step3p7"),
    "minicpmv4_6": Served({"minicpmv4_6": MINICPM_VIDEO},
                          ("text_only", "one_image", "sliced_images", "video", "long_prompt"),
                          ("one_image",), "minicpmv4_6", video_seed=23),
    "qwen3_vl": Served({"qwen3_vl": VIDEO, "qwen3_vl_grpc": GRPC}, ("one_image", "video", "image_and_video"),
                       ("one_image", "video"), "qwen3_vl_grpc", video_seed=22,
                       quantized={"qwen3_vl_grpc": "fp8-block"}),
    "qwen3_vl_moe": Served({"qwen3_vl_moe": VIDEO}, ("text_only", "one_image", "video"), ("one_image",),
                           "qwen3_vl_moe", video_seed=24),
    "qwen3_5": Served({"qwen3_5": VIDEO}, ("text_only", "one_image", "video", "long_prompt"),
                      ("one_image", "video"), "qwen3_5", video_seed=25),
    "qwen3_5_moe": Served({"qwen3_5_moe": VIDEO}, ("one_image", "image_and_video"), ("one_image",),
                          "qwen3_5_moe", video_seed=26),
}
MOE_FAMILIES = ("qwen3_vl_moe", "qwen3_5_moe", "step3p7")


def checkpoints(family: str, name: str, tiny_checkpoint, quantized_checkpoint) -> tuple[str, str]:
    """(the checkpoint app `name` of `family` serves, the checkpoint its reference runs)."""
    if quantization := SERVED[family].quantized.get(name):
        return quantized_checkpoint(family, quantization)
    return tiny_checkpoint(family), tiny_checkpoint(family)


@pytest.fixture(scope="module")
def served(request, serve_ports, tiny_checkpoint, quantized_checkpoint):
    """(family, {app name: base URL}): the family's apps on the session's Serve instance, up while
    the tests of that family run (they are grouped by family)."""
    from ray import serve

    from deployments.serve.app import build_app

    family, apps = request.param, SERVED[request.param].apps
    for name, extra in apps.items():
        model_dir = checkpoints(family, name, tiny_checkpoint, quantized_checkpoint)[0]
        serve.run(build_app(_app_args(model_dir, name, **extra)), name=name, route_prefix=f"/{name}")
    try:
        yield family, {name: f"http://127.0.0.1:{serve_ports[0]}/{name}" for name in apps}
    finally:
        for name in apps:
            serve.delete(name)


# `case` is (family, case name): only the family groups the tests (a shared case name would interleave them)
@pytest.mark.parametrize("served,case", [(f, (f, c)) for f, s in SERVED.items() for c in s.cases],
                         ids=[f"{f}-{c}" for f, s in SERVED.items() for c in s.cases], indirect=["served"],
                         scope="module")
def test_http_and_grpc_equal_monolithic(served, case, tiny_checkpoint, quantized_checkpoint, serve_ports):
    """Each app's tokens are its checkpoint's (a quantized app's: its checkpoint dequantized)."""
    family, urls = served
    spec, max_tokens, messages = SERVED[family], CASE_TOKENS[family], family_cases(family)[case[1]]

    def expected(name: str) -> list[int]:
        return reference_generate(checkpoints(family, name, tiny_checkpoint, quantized_checkpoint)[1], messages,
                                  max_tokens)

    first, *others = spec.apps
    text, tokens = openai_chat(urls[first], first, messages, max_tokens, stream=False)
    assert tokens == expected(first)
    assert openai_chat(urls[first], first, messages, max_tokens, stream=True) == (text, tokens)
    if case[1] != "text_only":  # text goes to no encoder: nothing crosses a transport
        for name in others:
            got = openai_chat(urls[name], name, messages, max_tokens, stream=False)
            if name in spec.quantized:
                assert got[1] == expected(name), name
            else:
                assert got == (text, tokens), name
    if case[1] in spec.grpc_api:
        with VLMClient(f"127.0.0.1:{serve_ports[1]}", application=spec.grpc_app) as c:
            unary = c.generate(proto_messages(messages), max_tokens=max_tokens)
            streamed = list(c.stream(proto_messages(messages), max_tokens=max_tokens))
        want = expected(spec.grpc_app)
        assert list(unary.token_ids) == want == [t for r in streamed for t in r.token_ids]
        assert unary.text == "".join(r.text for r in streamed)
        if spec.grpc_app not in spec.quantized:
            assert unary.text == text


@pytest.mark.parametrize("served", [f for f, s in SERVED.items() if s.quantized], indirect=True)
def test_a_quantized_app_lists_its_format(served):
    """A family's app serving a quantized checkpoint says so in `GET /v1/models` (and the others null)."""
    import httpx

    family, urls = served
    for name, url in urls.items():
        [card] = httpx.get(url + "/v1/models", timeout=30).json()["data"]
        want = {"fp8-block": "fp8 (e4m3, 16x16 blocks)"}.get(SERVED[family].quantized.get(name))  # as read
        assert card["quantization"] == want, name


@pytest.mark.parametrize("served", [f for f, s in SERVED.items() if s.video_seed is not None], indirect=True)
def test_video_url_equals_monolithic_streamed_and_decoded_whole(served, tiny_checkpoint, quantized_checkpoint,
                                                                serve_ports):
    """A video file (mp4 `video_url`), decoded and sampled on the server at the family's own rate
    (Qwen3-VL: with the timestamps its processor writes from the sampled frames' numbers): a 3.4 s
    one streamed through the pipeline, a 0.6 s one (fewer than the app's `stream_min_frames` sampled)
    decoded whole, and on Qwen3-VL's gRPC app (`stream: false`) the long one whole too: the tokens
    of `generate`; the long one over the public gRPC API (`video_files`) too."""
    pytest.importorskip("av")
    from mmserve.rpc.vlm_client import user
    from tests.serve.test_video_url_serve import QUESTION, decoder_stats, reference_messages
    from tests.support.media_factory import video_file

    family, urls = served
    spec, max_tokens = SERVED[family], CASE_TOKENS[family]
    first = next(iter(spec.apps))
    for seconds, streams in ((3.4, True), (0.6, False)):
        data = video_file(seconds, 10, 56, 84, seed=spec.video_seed)
        expected = {name: reference_generate(checkpoints(family, name, tiny_checkpoint, quantized_checkpoint)[1],
                                             reference_messages(data), max_tokens) for name in spec.apps}
        for name in spec.apps if streams else [first]:
            before = decoder_stats(name)
            got = openai_chat(urls[name], name, reference_messages(data), max_tokens, stream=False)[1]
            assert got == expected[name], (name, seconds)
            assert decoder_stats(name)["streamed"] - before["streamed"] == (streams and name == first), (name, seconds)
        if streams:
            with VLMClient(f"127.0.0.1:{serve_ports[1]}", application=spec.grpc_app) as c:
                got = list(c.generate([user(QUESTION, video_files=[data])], max_tokens=max_tokens).token_ids)
            assert got == expected[spec.grpc_app]


@pytest.mark.parametrize("served", MOE_FAMILIES, indirect=True)
def test_concurrent_requests_to_a_moe_model_equal_monolithic(served, tiny_checkpoint):
    """Every case of a mixture-of-experts family at once: the steps batch the requests' tokens
    through the same experts (each expert's rows gathered from several requests)."""
    from concurrent.futures import ThreadPoolExecutor

    family, urls = served
    name, cases = next(iter(SERVED[family].apps)), family_cases(family)
    max_tokens = CASE_TOKENS[family]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = dict(zip(cases, pool.map(lambda m: openai_chat(urls[name], name, m, max_tokens, stream=True)[1],
                                       cases.values())))
    for case, messages in cases.items():
        assert got[case] == reference_generate(tiny_checkpoint(family), messages, max_tokens), case


@pytest.mark.parametrize("served", list(SERVED), indirect=True)
def test_a_session_of_requests_sharing_prefixes_equals_monolithic(served, tiny_checkpoint):
    """One server, requests one after another that share a system prompt and images with the ones
    before (cached prefixes, state snapshots), one past a 64-token chunk: each equals `generate`."""
    family, urls = served
    name = next(iter(SERVED[family].apps))
    for i, messages in enumerate(shared_prefix_sequence()):
        expected = reference_generate(tiny_checkpoint(family), messages, CASE_TOKENS[family])
        assert openai_chat(urls[name], name, messages, CASE_TOKENS[family], stream=False)[1] == expected, i
