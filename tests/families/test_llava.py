"""LLaVA (CLIP and SigLIP towers): the router's fixed image cost, and the long case is long.
(Served == `transformers` monolithic `generate`: through the runtimes,
tests/families/test_equivalence_runtime.py; the Serve app over HTTP and gRPC,
tests/serve/test_family_serve.py.)"""

import pytest

from mmserve.families import router_face
from mmserve.inputs.media import MediaItem, MediaKind
from tests.support.cases import LONG_TEXT
from tests.support.media_factory import image_bytes, video_frames
from tests.support.reference import load_reference

LLAVA = ("llava", "llava_siglip")


@pytest.fixture(params=LLAVA)
def llava_dir(request, llava_models) -> str:
    return llava_models[request.param]


def test_long_prompt_is_long(llava_dir):
    processor, _ = load_reference(llava_dir)
    assert len(processor.tokenizer(LONG_TEXT)["input_ids"]) > 1000


def test_every_image_costs_the_same_and_video_is_refused(llava_dir):
    from mmserve.errors import InvalidRequest

    face = router_face(llava_dir)
    small, large = (face.expand(MediaItem(MediaKind.IMAGE, (image_bytes(h, w, 5),)), 1 << 30) for h, w in
                    ((30, 40), (300, 500)))
    assert small.token_ids == large.token_ids and small.cost == large.cost == len(small.token_ids) > 0
    with pytest.raises(InvalidRequest, match="images only"):
        face.expand(MediaItem(MediaKind.VIDEO, tuple(video_frames(2, 56, 56, 1))), 1 << 30)
