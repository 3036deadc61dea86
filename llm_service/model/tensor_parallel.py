"""Tensor parallelism of one LLM replica: its decoder split over N ranks, one process each
(docs/tensor-parallel.md). Rank 0 schedules, samples and sends each step's inputs to the other
ranks (`TPGroup.broadcast`); every rank runs the same forward over its shard (`plan_shards`,
Megatron's split), joined by one all-reduce after each attention and MLP block.

Ray-free: `llm_service.model.model_runner.rank_main` is what a rank worker process runs.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import pickle
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from llm_service.model.layers import Linear

logger = logging.getLogger(__name__)

Rule = Callable[[torch.Tensor], torch.Tensor]
DEFAULT_TIMEOUT_S = 600.0


def rendezvous_store(init_method: str, rank: int, size: int, timeout: datetime.timedelta):
    """The group's key-value store at `init_method` (tcp://HOST:PORT). Rank 0 serves it on HOST alone:
    torch's own server (`init_method=` given to `init_process_group`) listens on every interface, with no
    authentication, whatever HOST says. The others connect to it."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        raise ValueError(f"tensor-parallel init_method {init_method!r}: expected tcp://HOST:PORT")
    if rank != 0:
        return dist.TCPStore(url.hostname, url.port, size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET6 if ":" in url.hostname else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((url.hostname, url.port))
    listener.listen()
    return dist.TCPStore(url.hostname, url.port, size, True, timeout=timeout, master_listen_fd=listener.detach())


class TPGroup:
    """This process's place in a replica's tensor-parallel group (`torch.distributed`: NCCL on
    CUDA with a gloo group beside it for the step messages, gloo on CPU). Counts its collectives:
    `counts["all_reduce"]`, `counts["broadcast"]`."""

    def __init__(self, rank: int, size: int, init_method: str, device: torch.device,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.rank, self.size, self.device = rank, size, torch.device(device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # NCCL's communicator binds to the current device
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, store=rendezvous_store(init_method, rank, size, timeout), rank=rank,
                                world_size=size, timeout=timeout)
        self.control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        self.counts: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # host seconds inside each kind (the slowest rank's wait
        # included; on CUDA an NCCL collective's is its launch)
        self.broken = False  # a collective failed (a rank died): the group can run no other
        logger.info("tensor-parallel rank %d of %d joined (%s)", rank, size, backend)

    @contextlib.contextmanager
    def _collective(self, name: str):
        start = time.perf_counter()
        try:
            yield
        except Exception:
            self.broken = True
            raise
        self.seconds[name] += time.perf_counter() - start
        self.counts[name] += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        with self._collective("all_reduce"):
            dist.all_reduce(x)
        return x

    def broadcast(self, message=None):
        """Rank 0 sends `message` (picklable; tensors on the host), the others return it."""
        box = [message]
        with self._collective("broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Rank 0: the whole `(rows, vocab)` logits from every rank's vocabulary slice; the
        others send theirs and get None."""
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        with self._collective("gather"):
            dist.gather(logits.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1)[..., :vocab_size] if self.rank == 0 else None

    def agree_min(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """The smallest of each value over the ranks (pool sizes every rank can hold)."""
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return tuple(int(v) for v in t.tolist())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------- the split


def part(total: int, rank: int, size: int) -> tuple[int, int]:
    """`(first, count)` of the `total` heads rank `rank` holds: an even share when `total` splits
    over `size`, else (fewer heads than ranks) the one head its rank's group shares."""
    if total % size == 0:
        return rank * (total // size), total // size
    if size % total == 0:
        return rank // (size // total), 1
    raise ValueError(f"{total} heads split over neither {size} ranks nor a divisor of them")


def rows(blocks: int, first: int, count: int, dim: int = 0) -> Rule:
    """Blocks `first .. first + count` of `blocks` equal blocks along `dim`."""
    def take(t: torch.Tensor) -> torch.Tensor:
        size = t.shape[dim] // blocks
        return t.narrow(dim, first * size, count * size)
    return take


def segments(sizes: tuple[int, ...], rules: tuple[Rule, ...], dim: int = 0) -> Rule:
    """A fused tensor of segments `sizes` along `dim` (e.g. [q | k | v]), each split by its rule."""
    def take(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([rule(piece) for piece, rule in zip(t.split(list(sizes), dim), rules)], dim)
    return take


def vocab_rows(vocab: int, rank: int, size: int) -> Rule:
    """Rank `rank`'s slice of a `(vocab, hidden)` table: `ceil(vocab / size)` rows, the last
    slice padded with zero rows."""
    per = -(-vocab // size)

    def take(t: torch.Tensor) -> torch.Tensor:
        piece = t[rank * per:(rank + 1) * per]
        return piece if len(piece) == per else torch.cat([piece, piece.new_zeros(per - len(piece), *piece.shape[1:])])
    return take


class VocabParallelEmbedding(nn.Embedding):
    """An embedding table split by vocabulary: each rank looks up the ids in its slice (zeros for
    the others), one all-reduce sums the slices' rows. Set on `nn.Embedding` by class swap."""

    group: TPGroup
    first: int  # the first id of this rank's slice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(rows.masked_fill_(outside.unsqueeze(-1), 0))


def split_embedding(embed: nn.Embedding, group: TPGroup, vocab: int) -> None:
    """`embed` (this rank's slice of rows already) looks up as `VocabParallelEmbedding`."""
    embed.__class__ = VocabParallelEmbedding
    embed.group, embed.first = group, group.rank * -(-vocab // group.size)


@dataclass
class ShardPlan:
    """What rank `rank` of `size` holds: a rule per sharded module key (the full tensor -> this
    rank's part); keys without one are whole."""

    rank: int
    size: int
    rules: dict[str, Rule]

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        rule = self.rules.get(name)
        return tensor if rule is None else rule(tensor)


def _weight_and_bias(rules: dict[str, Rule], prefix: str, module: nn.Module, rule: Rule,
                     rank: int | None = None) -> None:
    """`rule` for the weight and bias; with `rank`, a row-parallel layer's: its bias added once (rank 0),
    the others hold zeros."""
    rules[f"{prefix}weight"] = rule
    if module.bias is not None:
        rules[f"{prefix}bias"] = rule if rank is None else (lambda t: t) if rank == 0 else torch.zeros_like


def _packed(prefix: str, linear: Linear, slice_rules: tuple[Rule, ...], rules: dict[str, Rule]) -> None:
    """A packed `Linear` of the engine's own layer ([q | k | v], [gate | up]): each output slice
    split by its rule; the linear's slices become this rank's."""
    _weight_and_bias(rules, prefix, linear, segments(linear.output_sizes, slice_rules))
    linear.output_sizes = tuple(r(torch.empty(n, device="meta")).shape[0]
                                for n, r in zip(linear.output_sizes, slice_rules))


def _attention(prefix: str, attn: nn.Module, rank: int, size: int, rules: dict[str, Rule]) -> None:
    heads = attn.o_proj.weight.shape[1] // attn.head_dim
    packed = getattr(attn, "qkv_proj", None)  # the engine's own layer
    kv_heads = (packed.output_sizes[1] if packed is not None else attn.k_proj.weight.shape[0]) // attn.head_dim
    if heads % size:
        raise ValueError(f"{heads} attention heads do not split over {size} ranks")
    q_first, q_count = part(heads, rank, size)
    kv_first, kv_count = part(kv_heads, rank, size)
    q, kv = rows(heads, q_first, q_count), rows(kv_heads, kv_first, kv_count)
    if packed is not None:
        _packed(f"{prefix}qkv_proj.", packed, (q, kv, kv), rules)
    for name, rule in (("q_proj", q), ("g_proj", q), ("k_proj", kv), ("v_proj", kv)):  # g_proj: Step3's gate per head
        if (proj := getattr(attn, name, None)) is not None:
            _weight_and_bias(rules, f"{prefix}{name}.", proj, rule)
    _weight_and_bias(rules, f"{prefix}o_proj.", attn.o_proj, rows(heads, q_first, q_count, dim=1), rank)
    for attr, value in (("num_heads", q_count), ("num_attention_heads", q_count),
                        ("num_key_value_heads", kv_count), ("num_key_value_groups", q_count // kv_count)):
        if hasattr(attn, attr):
            setattr(attn, attr, value)


def _linear_attention(prefix: str, lin: nn.Module, rank: int, size: int, rules: dict[str, Rule]) -> None:
    """Gated-DeltaNet: query/key heads (`num_k_heads`) and value heads (`num_v_heads`)."""
    hk, hv = lin.num_k_heads, lin.num_v_heads
    if hv % size:
        raise ValueError(f"{hv} linear-attention value heads do not split over {size} ranks")
    k_first, k_count = part(hk, rank, size)
    v_first, v_count = part(hv, rank, size)
    key, value = rows(hk, k_first, k_count), rows(hv, v_first, v_count)
    qkv = segments((lin.key_dim, lin.key_dim, lin.value_dim), (key, key, value))
    rules[f"{prefix}in_proj_qkv.weight"] = qkv
    _weight_and_bias(rules, f"{prefix}conv1d.", lin.conv1d, qkv)
    for name in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "dt_bias", "A_log"):
        rules[prefix + name] = value
    rules[f"{prefix}out_proj.weight"] = rows(hv, v_first, v_count, dim=1)
    lin.num_k_heads, lin.num_v_heads = k_count, v_count
    lin.key_dim, lin.value_dim = k_count * lin.head_k_dim, v_count * lin.head_v_dim
    lin.conv_dim = 2 * lin.key_dim + lin.value_dim


def _mlp(prefix: str, mlp: nn.Module, rank: int, size: int, rules: dict[str, Rule]) -> None:
    """A dense SiLU MLP, an experts module, or a MoE block of both (experts, shared experts)."""
    packed = getattr(mlp, "gate_up_proj", None)
    packed = packed if isinstance(packed, Linear) else None  # the engine's own layer (not experts' tensor)
    if (packed is not None or hasattr(mlp, "gate_proj")) and hasattr(mlp, "down_proj"):
        inter = packed.output_sizes[0] if packed is not None else mlp.gate_proj.weight.shape[0]
        if inter % size:
            raise ValueError(f"MLP intermediate size {inter} does not split over {size} ranks")
        col = rows(size, rank, 1)
        if packed is not None:
            _packed(f"{prefix}gate_up_proj.", packed, (col, col), rules)
        else:
            rules[f"{prefix}gate_proj.weight"] = rules[f"{prefix}up_proj.weight"] = col
        _weight_and_bias(rules, f"{prefix}down_proj.", mlp.down_proj, rows(size, rank, 1, dim=1), rank)
        return
    experts = getattr(mlp, "experts", None)
    if experts is not None and hasattr(experts, "gate_up_proj"):
        inter = experts.down_proj.shape[2]
        if inter % size:
            raise ValueError(f"expert intermediate size {inter} does not split over {size} ranks")
        half = rows(size, rank, 1, dim=1)
        rules[f"{prefix}experts.gate_up_proj"] = segments((inter, inter), (half, half), dim=1)
        rules[f"{prefix}experts.down_proj"] = rows(size, rank, 1, dim=2)
        if hasattr(experts, "intermediate_dim"):
            experts.intermediate_dim = inter // size
    for name in ("shared_expert", "shared_experts"):
        if (shared := getattr(mlp, name, None)) is not None:
            _mlp(f"{prefix}{name}.", shared, rank, size, rules)


def plan_shards(decoder: nn.Module, rank: int, size: int, vocab: int | None = None) -> ShardPlan:
    """The split of `decoder`'s layers for rank `rank` of `size` (module attributes that count
    heads are set to this rank's); with `vocab`, the embedding table and the `lm_head` too, by
    vocabulary."""
    rules: dict[str, Rule] = {}
    if vocab is not None:
        rules["decoder.embed_tokens.weight"] = rules["lm_head.weight"] = vocab_rows(vocab, rank, size)
    for i, layer in enumerate(decoder.layers):
        prefix = f"decoder.layers.{i}."
        if (attn := getattr(layer, "self_attn", None)) is not None:
            _attention(prefix + "self_attn.", attn, rank, size, rules)
        if (lin := getattr(layer, "linear_attn", None)) is not None:
            _linear_attention(prefix + "linear_attn.", lin, rank, size, rules)
        _mlp(prefix + "mlp.", layer.mlp, rank, size, rules)
    return ShardPlan(rank, size, rules)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside have their parameters on the meta device (one full-size parameter
    alive at a time) and their buffers where they are built (rotary tables keep their values)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def materialize(modules: nn.Module, plan: ShardPlan | None, device: torch.device) -> None:
    """Give every meta parameter of `modules` storage on `device`: this rank's shape for the
    sharded ones (the plan's rule applied to a meta tensor of the full shape), whole otherwise."""
    made: dict[int, nn.Parameter] = {}  # a tied parameter stays one tensor
    full_shapes = {}
    for name, param in list(modules.named_parameters(remove_duplicate=False)):
        if param.device.type != "meta":
            continue
        owner, _, attr = name.rpartition(".")
        if id(param) not in made:
            shape = plan.take(name, param).shape if plan else param.shape
            if shape != param.shape:
                full_shapes[name] = tuple(param.shape)
            made[id(param)] = nn.Parameter(torch.empty(shape, dtype=param.dtype, device=device), requires_grad=False)
        setattr(modules.get_submodule(owner), attr, made[id(param)])
    modules.full_shapes = full_shapes
    for module in modules.modules():
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape


def install_all_reduces(decoder: nn.Module, group: TPGroup) -> int:
    """One all-reduce on the output of each attention block (`self_attn`, `linear_attn`) and of
    each MLP block: the row-parallel layers' partial sums. Returns how many were installed."""

    def reduce(module, args, output):
        group.all_reduce(output[0] if isinstance(output, tuple) else output)
        return output

    blocks = [block for layer in decoder.layers for name in ("self_attn", "linear_attn", "mlp")
              if (block := getattr(layer, name, None)) is not None]
    for block in blocks:
        block.register_forward_hook(reduce)
    return len(blocks)


def local_state_specs(specs: tuple, decoder: nn.Module) -> tuple:
    """`StateSpec`s of a rank's Gated-DeltaNet layers: its channels and value heads."""
    from dataclasses import replace

    lins = [decoder.layers[spec.layer_idx].linear_attn for spec in specs]
    return tuple(replace(spec, conv_shape=(lin.conv_dim, spec.conv_shape[1]),
                         recurrent_shape=(lin.num_v_heads, *spec.recurrent_shape[1:]))
                 for spec, lin in zip(specs, lins))


def message_bytes(message) -> int:
    """Pickled size of a step message (what the broadcast carries)."""
    return len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
