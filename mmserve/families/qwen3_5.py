"""Router face of Qwen3.5: Qwen3-VL's (the same `Qwen3VLProcessor` and `get_rope_index`), with
Qwen3.5's tool-call form, the XML one (`mmserve.request.tools`). Why nothing else differs:
docs/adding-a-family.md#pitfalls-met-adding-qwen35-qwen3_5-qwen3_5_moe.
"""

from __future__ import annotations

from mmserve.families.qwen3_vl import Qwen3VLRouterFace



class Qwen3_5RouterFace(Qwen3VLRouterFace):
    tool_call_format = "xml"


ROUTER_FACE = Qwen3_5RouterFace
