"""Tiny Qwen3.5 (`qwen3_5`): Qwen/Qwen3.5-* shrunk, natively multimodal with a hybrid decoder.

Structure as the published configs: a 16-px patch ViT with a learned position grid and no
DeepStack (`Qwen3_5VisionModel`), a `qwen3_5_text` decoder of Gated-DeltaNet linear-attention
layers and full-attention layers (3 of every 4 linear, `layer_types`), interleaved M-RoPE on a
quarter of each head (`partial_rotary_factor` 0.25, `mrope_section` [2, 1, 1] for the real
[11, 11, 10]), untied lm_head. `transformers` maps `qwen3_5` to `Qwen3VLProcessor` (the Qwen2-VL
image processor, the Qwen3-VL video processor with timestamps per temporal group), shrunk here as
Qwen3-VL's tiny one; the tokenizer has the Qwen3 special tokens.

The chat template is written after Qwen3.5's published one (the hub checkpoints'
`chat_template.jinja`): the same rendering of system, user, assistant and tool turns (contents
trimmed, media placeholders in place, `Picture N:` with `add_vision_id`, no media in a system
turn, earlier turns' reasoning dropped), of the tools section's layout (a `<tools>` list of JSON
signatures, calls as `<tool_call><function=NAME><parameter=ARG>` XML) with its instructions
shortened, and of the generation prompt, which opens a thinking block (`<think>\\n`) unless
`enable_thinking` is false (then an empty one).
"""

from __future__ import annotations

from mmserve.tiny import qwen3_vl
from mmserve.tiny.tokenizer import text_config

VARIANTS: dict[str, str] = {}

LAYERS = 4  # 3 linear-attention layers, then a full-attention one
HEAD_DIM = 32  # the rotary part: 8 of 32 dims (4 frequencies: mrope_section [2, 1, 1])
# Weights drawn at the builder's seed (offset 0): of offsets 0-9 (the tokenizer with Qwen3's plain
# added tokens), one where both families' greedy answers depend on the images, differ between all
# 8 of a set of text prompts, and end every forced tool call (greedy and sampled) before 800
# tokens; at other offsets the 8 prompts got as few as 2 answers, or greedy forced calls ran on
# to the limit, or the MoE sibling ignored the image.
INIT_SEED_OFFSET = 0

QWEN3_5_CHAT_TEMPLATE = """\
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, count_media, in_system=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if in_system %}{{- raise_exception('System message cannot contain images.') }}{%- endif %}
                {%- if count_media %}{%- set image_count.value = image_count.value + 1 %}{%- endif %}
                {%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if in_system %}{{- raise_exception('System message cannot contain videos.') }}{%- endif %}
                {%- if count_media %}{%- set video_count.value = video_count.value + 1 %}{%- endif %}
                {%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is not none and content is defined %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}{{- raise_exception('No messages provided.') }}{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nTo call a function, reply in this format with nothing after it:\\n\\n<tool_call>\\n'
        '<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n'
        '</function>\\n</tool_call>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true) | trim %}
        {%- if content %}{{- '\\n\\n' + content }}{%- endif %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content, false, true) | trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages | length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' %}
        {%- set content = render_content(message.content, false) | trim %}
        {%- if not (content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}{{- raise_exception('No user query found in messages.') }}{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true) | trim %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning | trim + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for call in message.tool_calls %}
                {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}
                {%- if not loop.first %}{{- '\\n' }}{%- elif content | trim %}{{- '\\n\\n' }}{%- endif %}
                {{- '<tool_call>\\n<function=' + call.name + '>\\n' }}
                {%- if call.arguments is defined %}
                    {%- for name, value in call.arguments | items %}
                        {{- '<parameter=' + name + '>\\n' }}
                        {{- value | string if value is string else value | tojson | safe }}
                        {{- '\\n</parameter>\\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}"""


def text_overrides(tokenizer, **overrides) -> dict:
    """The tiny `qwen3_5_text` decoder's fields (`overrides`: the MoE sibling's)."""
    return text_config(
        tokenizer, num_hidden_layers=LAYERS, head_dim=HEAD_DIM, tie_word_embeddings=False,
        layer_types=["linear_attention"] * (LAYERS - 1) + ["full_attention"],
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    ) | overrides


def vision_fields() -> dict:
    """The tiny ViT: Qwen3-VL's without DeepStack."""
    return dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, in_channels=3, out_hidden_size=64,
                patch_size=qwen3_vl.PATCH_SIZE, spatial_merge_size=qwen3_vl.MERGE_SIZE, temporal_patch_size=2,
                num_position_embeddings=64, initializer_range=0.2)


def config(tokenizer, config_class=None, **text):
    """The tiny `Qwen3_5Config` (`config_class`, `text`: the MoE sibling's class and decoder fields)."""
    from transformers import Qwen3_5Config

    ids = tokenizer.convert_tokens_to_ids
    return (config_class or Qwen3_5Config)(
        text_config=text_overrides(tokenizer, **text), vision_config=vision_fields(),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
    )


def build(name: str, seed: int, make_config=config):
    """The tiny Qwen3.5 (see `mmserve.tiny` for the contract): Qwen3-VL's processor and tokenizer,
    the Qwen3.5 config and chat template."""
    config, processor, eos_ids, _ = qwen3_vl.build(name, seed, make_config, QWEN3_5_CHAT_TEMPLATE)
    return config, processor, eos_ids, seed + INIT_SEED_OFFSET
