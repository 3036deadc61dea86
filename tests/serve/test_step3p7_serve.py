"""Step3 through the Serve app with the `openai` client (streaming == non-streaming) == monolithic generate."""

import pytest

from tests.support.reference import reference_generate
from tests.support.serve_fixtures import _app_args
from tests.families.test_llava import _chat
from tests.families.test_step3p7 import CASES, MAX_TOKENS, step3_dir  # noqa: F401  (fixture)

NAME = "step3p7"


@pytest.fixture(scope="module")
def step3_app(serve_ports, step3_dir):  # noqa: F811
    from ray import serve

    from deployments.serve.app import build_app

    serve.run(build_app(_app_args(step3_dir, NAME)), name=NAME, route_prefix=f"/{NAME}")
    try:
        yield f"http://127.0.0.1:{serve_ports[0]}/{NAME}"
    finally:
        serve.delete(NAME)


@pytest.mark.serve
@pytest.mark.parametrize("case", ["text_only", "three_images", "long_prompt"])
def test_serve_app_equals_monolithic(step3_app, step3_dir, case):  # noqa: F811
    messages = CASES[case]()
    expected = reference_generate(step3_dir, messages, MAX_TOKENS)
    text, tokens = _chat(step3_app, NAME, messages, stream=False)
    assert tokens == expected
    assert _chat(step3_app, NAME, messages, stream=True) == (text, tokens)
