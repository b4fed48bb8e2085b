"""Where a pipeline's stage boundaries fall (docs/protocol.md section 8.6): each stage's work in
proportion to its node's speed, no node more layers than its memory holds.

:func:`plan_boundaries` takes the model's sizes (:class:`StageModel`: its layer count, the bytes
of one layer, the extras the first stage holds, the embeddings, and the last, the final norm
and the LM head, and the LM head's work a token counted in layers) and, per stage in order, its
node's free memory and speed
(:class:`StageNode`), and returns each stage's end layer, as ``--pipeline-layers`` gives them.
:func:`stage_node` makes a :class:`StageNode` of what a node reports (HELLO_ACK_F and NODE_STATUS,
section 7.5 and 12.9), and :func:`model_sizes` a :class:`StageModel` of a model's config.json.

This module must never do I/O, read a clock or touch a link: it is plain arithmetic on values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sfnode.linkf.wire import CapacitySummary

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


class StagePlanError(ValueError):
    """The stage nodes together cannot hold the model (or one cannot hold its share)."""


@dataclass(frozen=True, slots=True)
class StageModel:
    """What a pipeline splits: ``n_layers`` layers of ``layer_bytes`` each (0: unknown, memory
    then bounds nothing), plus ``first_bytes`` on the first stage and ``last_bytes`` on the
    last; ``head_layers`` is the last stage's LM head's work a token in layers (its weights
    over one layer's: the product of every row with the whole vocabulary, tied to the
    embeddings or not; 0: unknown, or none)."""

    n_layers: int
    layer_bytes: int = 0
    first_bytes: int = 0
    last_bytes: int = 0
    head_layers: float = 0.0


@dataclass(frozen=True, slots=True)
class StageNode:
    """One stage's node: the bytes it can give to layers (None: unknown, no bound), and its
    speed (any positive figure that orders nodes by speed; None or 0: unknown)."""

    free_bytes: int | None = None
    speed: float | None = None


def stage_node(capacity: CapacitySummary | None, resident_bytes: int | None) -> StageNode:
    """A node's free memory and speed from its reports: the GPU's free memory when it reports
    a GPU, else its host's memory less its own resident memory (NODE_STATUS, D27; the host's
    whole memory before the first NODE_STATUS); its busy-time decode rate (0 before it ever
    decoded: unknown)."""
    if capacity is None:
        return StageNode()
    if capacity.gpu_memory_bytes > 0:
        free: int | None = capacity.gpu_memory_free_bytes
    elif capacity.host_memory_bytes > 0:
        free = max(0, capacity.host_memory_bytes - (resident_bytes or 0))
    else:
        free = None
    return StageNode(free, float(capacity.decode_tokens_per_s) or None)


def model_sizes(config: Mapping[str, object], n_layers: int) -> StageModel:
    """A decoder's sizes from its config.json (``hidden_size``, ``intermediate_size``, the
    head counts, ``vocab_size``, ``torch_dtype``): the parameters of one attention and MLP
    block with its two norms; the embeddings on the first stage, the final norm and the LM
    head (none when tied, only the norm) on the last; the LM head's work in layers.  A config
    without those sizes gives ``StageModel(n_layers)`` (memory then bounds nothing, and the
    layers follow speed alone).  The ``config.json`` sfnode writes for a GGUF file (marked
    ``sfnode_family``) gives the work but no bytes: a GGUF parameter's bytes depend on its
    file's kinds and the node's weights mode."""
    sizes = [config.get(k) for k in ("hidden_size", "intermediate_size", "vocab_size")]
    if not all(isinstance(v, int) and v > 0 for v in sizes):
        return StageModel(n_layers)
    hidden, intermediate, vocab = (int(v) for v in sizes)  # type: ignore[call-overload]
    heads = _positive(config.get("num_attention_heads"), 1)
    kv_heads = _positive(config.get("num_key_value_heads"), heads)
    head_dim = _positive(config.get("head_dim"), hidden // heads)
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    per_layer = attention + 3 * hidden * intermediate + 2 * hidden
    head_layers = vocab * hidden / per_layer
    if "sfnode_family" in config:
        return StageModel(n_layers, head_layers=head_layers)
    width = _DTYPE_BYTES.get(str(config.get("torch_dtype")), 4)
    head = hidden if config.get("tie_word_embeddings") else hidden + vocab * hidden
    return StageModel(
        n_layers, per_layer * width, vocab * hidden * width, head * width, head_layers
    )


def _positive(value: object, default: int) -> int:
    return value if isinstance(value, int) and value > 0 else default


def plan_boundaries(model: StageModel, nodes: Sequence[StageNode]) -> list[int]:
    """Each stage's end layer: every stage at least one layer, each stage's work in proportion
    to its node's speed (a node of unknown speed counts as the mean of the known ones, all
    equal when none is known), and no node more layers than its free memory holds after its
    stage's extras.  A stage's work is its layers, the last stage's plus the LM head's
    ``head_layers``: so equal speeds give the even boundaries, ``((i+1)·n_layers) // P``,
    only for a model whose head's work is unknown, and otherwise fewer layers to the last.

    :raises StagePlanError: a node cannot hold one layer and its extras, or the nodes together
        cannot hold the model.
    """
    count, n = len(nodes), model.n_layers
    if count < 1 or n < count:
        raise StagePlanError(f"cannot split {n} layers over {count} stages")
    caps = [_cap(model, node, i, count) for i, node in enumerate(nodes)]
    if min(caps) < 1 or sum(caps) < n:
        raise StagePlanError(_short(model, nodes, caps))
    known = [node.speed for node in nodes if node.speed]
    mean = sum(known) / len(known) if known else 1.0
    speeds = [node.speed or mean for node in nodes]
    # Shares of the work, the head's counted as layers of the last stage, then the head's
    # taken off the last stage's share again; no stage more layers than leave the others
    # one each.
    head = model.head_layers
    most = [float(min(cap, n - count + 1)) for cap in caps]
    floors = [1.0] * (count - 1) + [1.0 + head]
    ceilings = [*most[:-1], most[-1] + head]
    shares = _shares(n + head, speeds, ceilings, floors)
    shares[-1] -= head
    boundaries, total = [], 0.0
    for share in shares[:-1]:
        total += share
        # Rounding the running total down: equal speeds give the even boundaries, and each
        # stage gets within one layer of its share (never past its cap: caps are whole).
        boundaries.append(math.floor(total + 1e-9))
    return [*boundaries, n]


def _cap(model: StageModel, node: StageNode, i: int, count: int) -> int:
    """The most layers stage ``i``'s node holds (``n_layers`` when memory bounds nothing)."""
    if model.layer_bytes <= 0 or node.free_bytes is None:
        return model.n_layers
    extras = (model.first_bytes if i == 0 else 0) + (model.last_bytes if i == count - 1 else 0)
    return max(0, min(model.n_layers, (node.free_bytes - extras) // model.layer_bytes))


def _shares(
    work: float, speeds: Sequence[float], caps: Sequence[float], floors: Sequence[float]
) -> list[float]:
    """Each stage's share of ``work``, in proportion to ``speeds`` among the stages not held
    at a bound: a stage whose share passes its cap is held at its cap, then one whose share
    falls under its floor is held at its floor."""
    held: dict[int, float] = {}
    while True:
        open_ = [i for i in range(len(speeds)) if i not in held]
        left = work - sum(held.values())
        total = sum(speeds[i] for i in open_)
        share = {i: left * speeds[i] / total for i in open_}
        over = {i: caps[i] for i in open_ if share[i] > caps[i]}
        under = {i: floors[i] for i in open_ if share[i] < floors[i]}
        if not over and not under:
            return [held.get(i, share.get(i, 0.0)) for i in range(len(speeds))]
        held.update(over or under)
        if len(held) == len(speeds):
            return [held[i] for i in range(len(speeds))]


def _short(model: StageModel, nodes: Sequence[StageNode], caps: Sequence[int]) -> str:
    """Why the nodes cannot hold the model, in bytes."""
    need = model.n_layers * model.layer_bytes + model.first_bytes + model.last_bytes
    free = sum(node.free_bytes or 0 for node in nodes)
    small = [i for i, cap in enumerate(caps) if cap < 1]
    if small:
        return (
            f"stage {small[0]}'s node has {nodes[small[0]].free_bytes} bytes free: not one "
            f"layer ({model.layer_bytes} bytes) with its stage's extras"
        )
    return (
        f"the stage nodes cannot hold the model together: {need} bytes needed "
        f"({model.n_layers} layers of {model.layer_bytes}), {free} free, room for "
        f"{sum(caps)} layers"
    )
