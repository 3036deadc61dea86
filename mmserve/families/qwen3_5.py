"""Router face of Qwen3.5: Qwen3-VL's, with Qwen3.5's tool-call form.

The checkpoint's processor is `Qwen3VLProcessor` (`transformers`' processing_auto maps `qwen3_5`
to it): the Qwen2-VL image processor with 16-px patches, the Qwen3-VL video processor (frames x
height x width bounds, a timestamp and vision start/end around each temporal group); and
`Qwen3_5Model.get_rope_index` is Qwen3-VL's (each temporal group a `(1, h, w)` grid, interleaved
M-RoPE applied in the decoder's rotary embedding, which here rotates only `partial_rotary_factor`
of each head). What differs in Qwen3.5 is the chat template (a thinking block opened in the
generation prompt, a call's `arguments` taken as a mapping), which the router takes from the
checkpoint like every family's, and the tool calls' form: the XML one (`<function=NAME>`,
`<parameter=KEY>`, `mmserve.request.tools`), the face's `tool_call_format`.
"""

from __future__ import annotations

from mmserve.families.qwen3_vl import Qwen3VLRouterFace



class Qwen3_5RouterFace(Qwen3VLRouterFace):
    tool_call_format = "xml"


ROUTER_FACE = Qwen3_5RouterFace
