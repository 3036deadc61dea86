"""What the capacity planner (`mmserve.capacity.simulate`) is told: a `Profile` of service times (from a
file: `load_profile`, its transfer rates measured by bench/transfer.py: `with_transfer_rates`), a
`Workload`, a pool's `Autoscaling` and the `SLO`s."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

TRANSPORTS = ("object_store", "grpc")
COLOCATED_ENCODERS = ("beside", "in_step")  # Profile.colocated_encoder


# -- what the simulation is told ---------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    """Service times of one replica of each kind, on one GPU type (seconds)."""

    source: str  # where these figures come from: "hand-written: ..." or "fitted from ..."
    router_s: float = 0.002  # per request, before dispatch
    encode_batch_s: float = 0.005  # per encoder forward
    encode_token_s: float = 2e-5  # per image token of a forward
    max_batch_tokens: int = 16384  # the encoder pool's token budget
    # the transfer of embeddings to the LLM replica: bytes per embedding token (the LM's hidden
    # size x dtype bytes, DeepStack parts included) and seconds per byte on each transport
    embedding_token_bytes: int = 0
    object_store_byte_s: float = 0.0
    grpc_byte_s: float = 0.0
    step_s: float = 0.01  # per LLM step
    prefill_token_s: float = 1e-4  # per prefill token of a step
    decode_seq_s: float = 2e-4  # per decoding sequence of a step
    max_batched_tokens: int = 8192  # prefill tokens per step (chunked prefill)
    max_num_seqs: int = 64  # sequences running on one replica
    # the KV cache of one LLM replica, in tokens (None: never the limit). Prompts are admitted only
    # while it holds their chunks; when running sequences outgrow it, the youngest is preempted and
    # later recomputed (its prompt and the tokens it had), as the engine's scheduler does
    kv_tokens: int | None = None
    # None: each replica has its device; else the replicas share one box that runs this many of
    # their forwards / steps at full speed at once (fitted on a flood of the app on that box)
    shared_capacity: float | None = None
    # the router's admission: a request arriving while this many wait for their first token is
    # refused at once (429); None: every request is admitted
    max_pending_requests: int | None = None
    # the work a refused request still costs (the proxy and the router answering its 429), on the
    # replicas' shared cores where they share a box, else a delay that holds nothing
    refuse_s: float = 0.0
    # how a colocated replica's encoder shares its device: "beside" its steps (processor sharing:
    # mmserve's colocated replica, an encoder thread beside the engine) or "in_step" (one at a
    # time: vLLM's colocated engine runs the ViT inside the step, so decodes wait for it)
    colocated_encoder: str = "beside"

    def __post_init__(self):
        if self.colocated_encoder not in COLOCATED_ENCODERS:
            raise ValueError(f"colocated_encoder must be one of {COLOCATED_ENCODERS}, not {self.colocated_encoder!r}")

    def encode_seconds(self, tokens: float, items: int = 1) -> float:
        return self.encode_batch_s + self.encode_token_s * tokens

    def transfer_seconds(self, tokens: int, transport: str = "object_store") -> float:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        per_byte = self.object_store_byte_s if transport == "object_store" else self.grpc_byte_s
        return per_byte * self.embedding_token_bytes * tokens


@dataclass(frozen=True)
class Workload:
    """Requests arriving as a Poisson process (`burstiness` 1) or gamma (vLLM's `--burstiness`)."""

    rate: float  # requests per second
    images: tuple[int, int] = (1, 1)  # images per request, uniform in [low, high]
    image_tokens: int = 256  # embedding tokens per image (without `image_mix`)
    # the resolutions' mix: (embedding tokens per image, share of images); each image draws one
    image_mix: tuple[tuple[int, float], ...] = ()
    text_tokens: int = 64
    output_tokens: int = 64
    # text and output lengths uniform in [L x (1 - r), L x (1 + r)] (vLLM's --random-range-ratio)
    length_range_ratio: float = 0.0
    repeat_share: float = 0.0  # images served from the encoder cache
    burstiness: float = 1.0
    # content, for the routing simulation (`mmserve.capacity.routing`; the defaults: every image
    # unique, no shared prompt, no session): images drawn from `image_pool` by Zipf popularity
    # (rank k weighs k^-zipf_exponent), `system_prompt_share` of requests opening with one of
    # `system_prompts` shared prompts of `system_prompt_tokens`, and `multi_turn_share` of requests
    # the next turn of an earlier one (its prompt, its answer and new text; the same images)
    image_pool: int = 0
    zipf_exponent: float = 1.0
    system_prompts: int = 0
    system_prompt_share: float = 0.0
    system_prompt_tokens: int = 512
    multi_turn_share: float = 0.0

    def __post_init__(self):
        if any(tokens < 1 or share < 0 for tokens, share in self.image_mix) or (
                self.image_mix and not sum(share for _, share in self.image_mix) > 0):
            raise ValueError(f"image_mix needs positive token counts and shares summing above 0: {self.image_mix}")
        if not 0 <= self.length_range_ratio < 1:
            raise ValueError(f"length_range_ratio must be in [0, 1): {self.length_range_ratio}")
        if self.image_pool < 0 or self.zipf_exponent < 0 or not 0 <= self.system_prompt_share <= 1 or \
                not 0 <= self.multi_turn_share < 1 or (self.system_prompt_share and self.system_prompts < 1):
            raise ValueError("content needs image_pool >= 0, zipf_exponent >= 0, shares in [0, 1] (multi_turn_share "
                             "below 1) and system_prompts >= 1 where system_prompt_share > 0")

    def image_sizes(self, images: int, rng: random.Random) -> tuple[int, ...]:
        """Embedding tokens of each of a request's `images` (drawn from `image_mix`, if any)."""
        if not self.image_mix:
            return (self.image_tokens,) * images
        sizes, shares = zip(*self.image_mix)
        return tuple(rng.choices(sizes, shares, k=images))

    def length(self, mean: int, rng: random.Random) -> int:
        if not self.length_range_ratio:
            return mean
        spread_ = round(mean * self.length_range_ratio)
        return max(1, rng.randint(mean - spread_, mean + spread_))

    @property
    def mean_image_tokens(self) -> float:
        mix = self.image_mix
        return sum(t * s for t, s in mix) / sum(s for _, s in mix) if mix else float(self.image_tokens)


@dataclass(frozen=True)
class Autoscaling:
    """A pool's autoscaling as the app configures Serve's: the encoder pool on image tokens queued
    per replica (`encoder_pool.target_queued_tokens_per_replica`), the LLM pool on requests in
    flight per replica (`target_ongoing_requests`). The policy reads the load every `interval_s`;
    Serve acts on an ask that held for its delay; a replica serves `start_s` after it is asked for
    (placement, loading its weights, warm-up)."""

    min_replicas: int
    max_replicas: int
    target_per_replica: float
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    start_s: float = 60.0
    interval_s: float = 1.0

    def __post_init__(self):
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1 or self.target_per_replica <= 0:
            raise ValueError(f"autoscaling needs 0 <= min_replicas <= max_replicas, max_replicas >= 1 and a "
                             f"positive target per replica: {self}")


@dataclass(frozen=True)
class SLO:
    ttft_p99_s: float
    tpot_p99_s: float


PROFILES = Path(__file__).resolve().parent / "profiles"  # the bundled profiles (package data)


def load_profile(path: str) -> Profile:
    """A profile file (YAML or JSON: `Profile`'s fields; `source` says where its figures come from),
    or a bundled profile by name (a file of `PROFILES` less its `.yaml`)."""
    import yaml

    if (PROFILES / f"{path}.yaml").is_file() and Path(path).name == path:
        path = str(PROFILES / f"{path}.yaml")
    with open(path) as f:
        data = yaml.safe_load(f)
    if unknown := set(data) - set(Profile.__dataclass_fields__):
        raise ValueError(f"{path}: unknown profile fields {sorted(unknown)}")
    return Profile(**data)


def with_changes(profile: Profile, changes: list[str]) -> Profile:
    """The profile with `FIELD=VALUE` changes (`mmserve plan --set`: what if the encoder were twice
    as fast?); its source lists them."""
    values = {}
    for change in changes:
        name, sep, text = change.partition("=")
        field = Profile.__dataclass_fields__.get(name)
        if not sep or field is None or name == "source":
            raise ValueError(f"--set {change!r}: give FIELD=VALUE, FIELD one of the profile's "
                             f"{sorted(set(Profile.__dataclass_fields__) - {'source'})}")
        if field.type == "str":
            values[name] = text
            continue
        integral = "int" in str(field.type)  # `int`, or `int | None`
        try:
            values[name] = None if text.lower() == "none" and "None" in str(field.type) else \
                (int(text) if integral else float(text))
        except ValueError:
            raise ValueError(f"--set {change!r}: {name} takes {'a whole number' if integral else 'a number'}") from None
    if not values:
        return profile
    listed = ", ".join(f"{k}={v}" for k, v in values.items())
    return replace(profile, **values, source=f"{profile.source}; changed here: {listed}")


def with_transfer_rates(profile: Profile, path: str) -> Profile:
    """The profile with both transports' per-byte times measured by `python bench/transfer.py`
    (its last line: `object_store_mb_s_20mb`, `grpc_mb_s_20mb`, the 20 MB rows); its source says so."""
    import json

    with open(path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    try:
        summary = json.loads(lines[-1])
        rates = {t: float(summary[f"{t}_mb_s_20mb"]) for t in TRANSPORTS}
    except (IndexError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not bench/transfer.py's output (its last line, a JSON object with "
                         f"object_store_mb_s_20mb and grpc_mb_s_20mb): {e!r}") from None
    if min(rates.values()) <= 0:
        raise ValueError(f"{path}: transfer rates must be positive: {rates}")
    return replace(profile, object_store_byte_s=1 / (rates["object_store"] * 1e6),
                   grpc_byte_s=1 / (rates["grpc"] * 1e6),
                   source=f"{profile.source}; transfer measured by bench/transfer.py ({path}: "
                          f"{rates['object_store']:.0f} MB/s object store, {rates['grpc']:.0f} MB/s gRPC)")
