"""LLaVA (CLIP and SigLIP towers) served disaggregated == `transformers` monolithic `generate`:
through the runtimes, the Serve app (openai client, streaming and not) and gRPC."""

import pytest

from mmserve.rpc.vlm_client import VLMClient
from mmserve.families import router_face
from mmserve.request.media import MediaItem, MediaKind
from tests.support.cases import LONG_TEXT, openai_chat
from tests.support.media_factory import image_bytes, video_frames
from tests.support.pipeline import served_generate
from tests.support.reference import load_reference, reference_generate
from tests.support.serve_fixtures import _app_args
from tests.serve.test_grpc_serve import proto_messages

LLAVA = ("llava", "llava_siglip")
MAX_TOKENS = 8


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def _text(t):
    return {"type": "text", "text": t}


def _image(h, w, seed):
    return {"type": "image", "bytes": image_bytes(h, w, seed)}


CASES = {
    "text_only": lambda: _user(_text("Hello, who are you? Tell me about the sky.")),
    "one_image": lambda: _user(_image(64, 96, 1), _text("Describe this image.")),
    "three_images": lambda: _user(_image(56, 56, 2), _text("Compare with"), _image(120, 40, 3),
                                  _image(90, 200, 4), _text("please.")),
    "long_prompt": lambda: _user(_image(64, 64, 8), _text(LONG_TEXT)),
}


@pytest.fixture(params=LLAVA)
def llava_dir(request, llava_models) -> str:
    return llava_models[request.param]


@pytest.mark.parametrize("case", list(CASES))
def test_runtimes_equal_monolithic(llava_dir, case):
    messages = CASES[case]()
    if case == "long_prompt":
        processor, _ = load_reference(llava_dir)
        assert len(processor.tokenizer(LONG_TEXT)["input_ids"]) > 1000
    assert served_generate(llava_dir, messages, MAX_TOKENS) == reference_generate(llava_dir, messages, MAX_TOKENS)


def test_every_image_costs_the_same_and_video_is_refused(llava_dir):
    from mmserve.errors import InvalidRequest

    face = router_face(llava_dir)
    small, large = (face.expand(MediaItem(MediaKind.IMAGE, (image_bytes(h, w, 5),)), 1 << 30) for h, w in
                    ((30, 40), (300, 500)))
    assert small.token_ids == large.token_ids and small.cost == large.cost == len(small.token_ids) > 0
    with pytest.raises(InvalidRequest, match="images only"):
        face.expand(MediaItem(MediaKind.VIDEO, tuple(video_frames(2, 56, 56, 1))), 1 << 30)


@pytest.fixture(scope="module")
def llava_apps(serve_ports, llava_models):
    """One float64 app per LLaVA variant on the session's Serve instance: {name: base URL}."""
    from ray import serve

    from deployments.serve.app import build_app

    for name in LLAVA:
        serve.run(build_app(_app_args(llava_models[name], name)), name=name, route_prefix=f"/{name}")
    try:
        yield {name: f"http://127.0.0.1:{serve_ports[0]}/{name}" for name in LLAVA}
    finally:
        for name in LLAVA:
            serve.delete(name)


def _chat(url, name, messages, stream):
    return openai_chat(url, name, messages, MAX_TOKENS, stream)


@pytest.mark.serve
@pytest.mark.parametrize("name", LLAVA)
@pytest.mark.parametrize("case", ["one_image", "three_images"])
def test_serve_app_http_and_grpc_equal_monolithic(llava_apps, llava_models, serve_ports, name, case):
    messages = CASES[case]()
    expected = reference_generate(llava_models[name], messages, MAX_TOKENS)
    text, tokens = _chat(llava_apps[name], name, messages, stream=False)
    assert tokens == expected
    assert _chat(llava_apps[name], name, messages, stream=True) == (text, tokens)
    if case == "one_image":  # the gRPC API carries images before the message's text, as LLaVA's template does
        with VLMClient(f"127.0.0.1:{serve_ports[1]}", application=name) as c:
            unary = c.generate(proto_messages(messages), max_tokens=MAX_TOKENS)
        assert list(unary.token_ids) == expected and unary.text == text
