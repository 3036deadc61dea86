"""The prompts the equivalence tests run (transformers chat shape, media as bytes): the builders
`user`, `text`, `image`, `video`, `image_question`; `cases()` (the Qwen2-VL families' prompts) and each other
family's own prompts (`family_cases`); the same prompts as a served app takes them (`api_messages`:
OpenAI chat, `proto_messages`: `mmserve.v1`), and one chat completion with the `openai` client."""

from __future__ import annotations

from tests.support.media_factory import data_uri, image_bytes, video_frames

LONG_TEXT = " ".join(f"word{i % 97} and the {i % 13} cat sat on mat number {i}." for i in range(140))


def user(*parts: dict) -> list[dict]:
    """One user message of `parts`."""
    return [{"role": "user", "content": list(parts)}]


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(h: int, w: int, seed: int) -> dict:
    return {"type": "image", "bytes": image_bytes(h, w, seed)}


def video(n: int, h: int, w: int, seed: int, fps: float = 2.0) -> dict:
    """`n` frames of `h` x `w` (pre-extracted, as the processor's `videos` take them) at `fps`."""
    return {"type": "video", "frames": video_frames(n, h, w, seed), "fps": fps}


def image_question(*images: dict, question: str = "Describe the image.") -> list[dict]:
    """One user message: `images` (from `image`), then `question`."""
    return user(*images, text(question))


def cases() -> dict[str, list[dict]]:
    return {
        "text_only": user(text("Hello, who are you? Tell me about the sky.")),
        "one_image": user(image(64, 96, 1), text("Describe this image.")),
        "three_images": user(
            text("Compare "), image(56, 56, 2), text(" with "), image(120, 40, 3), image(90, 200, 4),
            text(" please."),
        ),
        "video": user(video(4, 56, 84, 5, fps=1.0), text("What happens in the video?")),
        "image_and_video": user(image(80, 60, 6), video(3, 70, 70, 7, fps=4.0), text("Relate them.")),
        "long_prompt": [
            {"role": "system", "content": [text("You are terse.")]},
            {"role": "user", "content": [image(64, 64, 8), text(LONG_TEXT)]},
        ],
    }


def _llava() -> dict[str, list[dict]]:
    """Images only (the tower takes no video); the template puts a message's images before its text."""
    return {
        "text_only": user(text("Hello, who are you? Tell me about the sky.")),
        "one_image": user(image(64, 96, 1), text("Describe this image.")),
        "three_images": user(image(56, 56, 2), text("Compare with"), image(120, 40, 3), image(90, 200, 4),
                             text("please.")),
        "long_prompt": user(image(64, 64, 8), text(LONG_TEXT)),
    }


def _minicpmv() -> dict[str, list[dict]]:
    return {
        "text_only": user(text("Hello, who are you? Tell me about the sky.")),
        "one_image": user(image(64, 180, 1), text("Describe this image.")),
        # 2x2 and 1x2 slices beside a source view, and an image that takes none
        "sliced_images": user(text("Compare"), image(200, 200, 2), text("with"), image(90, 220, 3),
                              image(150, 60, 4), text("please.")),
        "video": user(video(3, 150, 120, 5, fps=2.0), text("What happens in the video?")),
        "long_prompt": user(image(120, 160, 8), text(LONG_TEXT)),  # > the 2,048-token step budget
    }


def _qwen3_vl() -> dict[str, list[dict]]:
    return {
        "text_only": user(text("Hello, who are you? Tell me about the sky.")),
        "one_image": user(image(64, 96, 1), text("Describe this image.")),
        "three_images": user(text("Compare "), image(56, 56, 2), text(" with "), image(120, 40, 3),
                             image(90, 200, 4), text(" please.")),
        "video": user(video(5, 64, 96, 5, fps=2.0), text("What happens in the video?")),
        "image_and_video": user(image(70, 40, 6), text("and"), video(4, 50, 90, 7, fps=3.0),
                                text("Describe both.")),
        "long_prompt": user(image(64, 64, 8), text(LONG_TEXT)),
    }


STEP3_LONG_TEXT = " ".join(["the cat sat on the mat"] * 12)  # > 3 sliding windows of the tiny LM


def _step3p7() -> dict[str, list[dict]]:
    """Images only; a small image takes no crops, a large one many."""
    return {
        "text_only": user(text("Hello, who are you? Tell me about the sky.")),
        "one_image": user(image(64, 180, 1), text("Describe this image.")),
        "three_images": user(image(50, 50, 2), text("Compare with"), image(200, 200, 3), image(90, 160, 4),
                             text("please.")),
        "long_prompt": user(image(120, 60, 8), text(STEP3_LONG_TEXT)),
    }


_FAMILY_CASES = {"qwen2_vl": cases, "qwen2_5_vl": cases, "llava": _llava, "llava_siglip": _llava,
                 "minicpmv4_6": _minicpmv, "qwen3_vl": _qwen3_vl, "qwen3_vl_moe": _qwen3_vl,
                 "qwen3_5": _qwen3_vl, "qwen3_5_moe": _qwen3_vl, "step3p7": _step3p7}
FAMILIES = tuple(_FAMILY_CASES)  # the tiny checkpoints (`mmserve.tiny.FAMILIES`) the cases are for
# greedy tokens a family's cases are compared on (the tiny checkpoints run them all)
CASE_TOKENS = {"qwen2_vl": 12, "qwen2_5_vl": 12, "llava": 8, "llava_siglip": 8, "minicpmv4_6": 12, "qwen3_vl": 8,
               "qwen3_vl_moe": 8, "qwen3_5": 8, "qwen3_5_moe": 8, "step3p7": 8}


def family_cases(family: str) -> dict[str, list[dict]]:
    """{case name: messages}: the prompts the tiny checkpoint `family` is checked on (made anew at each call)."""
    return _FAMILY_CASES[family]()


def shared_prefix_sequence() -> list[list[dict]]:
    """Requests to send one after another to one server, as a new user's session goes (issue 58):
    later ones share a system prompt and images with earlier ones (the prefix cache and, on hybrid
    models, state snapshots serve them), one runs past a Gated-DeltaNet chunk (64 tokens), images
    of several sizes, text with a trailing space (a template may trim it)."""
    system = {"role": "system", "content": [text("You are a careful assistant who answers in few words. " * 2)]}
    again = text("Again " * 60)
    return [
        [system, *user(text("Hello, who are you? "))],
        [system, *user(image(100, 150, 31), text("What is in this picture?"))],
        [system, *user(image(100, 150, 31), again)],
        [system, *user(image(170, 120, 32), image(100, 150, 31), text("Compare the two pictures. "))],
    ]


def api_messages(messages: list[dict]) -> list[dict]:
    """The reference shape (media as bytes) as OpenAI chat messages (media as data: URIs)."""
    def part(p):
        if p["type"] == "image":
            return {"type": "image_url", "image_url": {"url": data_uri(p["bytes"])}}
        if p["type"] == "video":
            return {"type": "video", "video": [data_uri(f) for f in p["frames"]], "fps": p["fps"]}
        if p["type"] == "video_file":
            return {"type": "video_url", "video_url": {"url": data_uri(p["bytes"], "video/mp4")}}
        return p

    return [{"role": m["role"], "content": [part(p) for p in m["content"]]} for m in messages]


def proto_messages(messages: list[dict]) -> list:
    """The reference shape (media as bytes) as `mmserve.v1` messages: a message's images, then its
    videos, then its text (the gRPC API carries them in that order)."""
    from mmserve.rpc.vlm_client import VideoFrames, user as proto_user

    out = []
    for m in messages:
        images = [p["bytes"] for p in m["content"] if p["type"] == "image"]
        videos = [VideoFrames(tuple(p["frames"]), p["fps"]) for p in m["content"] if p["type"] == "video"]
        out.append(proto_user("".join(p["text"] for p in m["content"] if p["type"] == "text"), images, videos))
    return out


def openai_chat(url: str, model: str, messages: list[dict], max_tokens: int, stream: bool) -> tuple[str, list[int]]:
    """(text, token ids) of one chat completion from the app at `url`, streamed or not."""
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return chat_completion(c, model, api_messages(messages), max_tokens, stream)


def chat_completion(c, model: str, messages: list[dict], max_tokens: int, stream: bool, **kw) -> tuple[str, list[int]]:
    """(text, token ids) of one chat completion of OpenAI-shaped `messages` by the `openai` client `c`."""
    resp = c.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, stream=stream,
                                     extra_body={"return_token_ids": True}, **kw)
    if not stream:
        return resp.choices[0].message.content, resp.choices[0].model_extra["token_ids"]
    pieces, tokens = [], []
    for chunk in resp:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            tokens += choice.model_extra.get("token_ids", [])
    return "".join(pieces), tokens
