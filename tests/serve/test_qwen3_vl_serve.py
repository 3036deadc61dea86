"""Qwen3-VL on Ray: an item's DeepStack parts cross `object_store` bit for bit. (Through the Serve
app == `transformers` monolithic `generate`: tests/serve/test_family_serve.py.)"""

import pytest
import torch

from tests.support.cases import family_cases
from tests.support.pipeline import runtimes, to_planner_messages

pytestmark = pytest.mark.serve


def test_deepstack_parts_cross_object_store_bit_identical(serve_ports, qwen3_dir):
    import ray

    planner, encoder, _ = runtimes(qwen3_dir)
    [emb] = encoder.encode(planner.plan(to_planner_messages(family_cases("qwen3_vl")["video"])).media)
    assert len(emb.parts) > 1
    back = ray.get(ray.put(emb))
    assert back.key == emb.key and len(back.parts) == len(emb.parts)
    assert all(torch.equal(b.view(torch.int64), p.view(torch.int64)) for b, p in zip(back.parts, emb.parts))
