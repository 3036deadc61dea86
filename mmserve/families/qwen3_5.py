"""Router face of Qwen3.5: Qwen3-VL's as it is.

The checkpoint's processor is `Qwen3VLProcessor` (`transformers`' processing_auto maps `qwen3_5`
to it): the Qwen2-VL image processor with 16-px patches, the Qwen3-VL video processor (frames x
height x width bounds, a timestamp and vision start/end around each temporal group); and
`Qwen3_5Model.get_rope_index` is Qwen3-VL's (each temporal group a `(1, h, w)` grid, interleaved
M-RoPE applied in the decoder's rotary embedding, which here rotates only `partial_rotary_factor`
of each head). What differs in Qwen3.5 is the chat template (a thinking block opened in the
generation prompt), which the router takes from the checkpoint like every family's.
"""

from __future__ import annotations

from mmserve.families.qwen3_vl import Qwen3VLRouterFace

ROUTER_FACE = Qwen3VLRouterFace
