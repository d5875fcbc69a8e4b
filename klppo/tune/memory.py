"""Predicted peak device memory of one rank, by phase (rollout, log-prob, update), term by term.

Notation (per rank): ``P`` parameters, ``f`` ranks in a shard group (``fsdp_size``, -1 → world size),
``Ps = ceil(P / f)`` the rank's shard, ``m`` master bytes (fp32: 4), ``c`` compute bytes (bf16: 2; no
mixed precision: 4), ``U_i`` own parameters of unit ``i`` (root ``U_r``), ``T`` tokens of a micro-batch,
``N = T · response_fraction`` tokens with logits, ``L`` layers, ``h`` hidden, ``I`` MLP width, ``kvd``
``kv_heads · head_dim``, ``V`` vocabulary, ``D`` device bytes. Formulas (``update`` phase):

- sharded params ``Ps·m``; sharded grads ``Ps·m`` (reduced in fp32, kept in the master dtype);
  AdamW ``2·Ps·4`` (exp_avg, exp_avg_sq). All three 0 with ``offload="cpu"`` (FSDP2 CPUOffloadPolicy:
  shards and optimizer live on the host). ``offload="idle"`` (verl's param_offload +
  optimizer_offload) moves them to the host *between* phases: the update loads both first, so the
  update peak is unchanged and only the rollout / log-prob phases get lighter.
- gathered units ``c·(U_r + W)``: the root (embeddings, final norm, tied head) is unsharded at both
  ends of the pass, around the logits and the LM head's backward; ``W`` = the largest window of units
  unsharded at once: one unit +
  the prefetched next (``backward_prefetch``/``forward_prefetch``), or all of them
  (``reshard_after_forward=False``: every unit stays gathered until its backward). With
  ``reshard_after_forward=True`` klppo passes the key to the root as well, and FSDP2 then reshards the
  root after the forward too (it keeps the root gathered only when the key is left unset): while the
  loss's logits are live nothing is gathered, and ``c·(U_r + W)`` belongs to a third moment, (c) below
  (counting the root as gathered throughout would overestimate every threshold's peak, the whole model as
  one unit included).
- on top of those, the larger of the moments of the backward:
  (a) *backward start*: activations, per token and layer saved for backward ``A = 8h + c·(5h + 2·kvd
  + 4I)`` (two RMSNorms' fp32 input and bf16 output, q and k after RoPE, v, attention output and its
  copy into o_proj, gate, up, silu(gate), their product): without checkpointing ``L·T·A``, with
  per-layer checkpointing ``L·T·h·c`` (layer inputs) ``+ T·A`` (one layer recomputed); a backward
  workspace ``T·c·(2h + 2I)``; logits ``N·V·(c + 12)`` (bf16 logits, their fp32 copy kept for
  backward, two fp32 [N, V] buffers of log-softmax's forward/backward; entropy adds ``N·V·8``); the
  LM head's weight gradient ``V·h·c``. (The LM head returns float32 logits directly —
  ``klppo.models.lm_head`` — so no bf16 logits are made: these terms overestimate by ``N·V·c``, and stay
  as the device peaks of ``tests/tune/test_memory.py`` were fitted with them.)
  (c) *head backward* (``reshard_after_forward=True`` only): the root and the window gathered again,
  the activations, the logits' fp32 gradient ``N·V·4`` (or the first layer's backward workspace, if
  larger) and the LM head's weight gradient. The root then stays gathered to the end of the backward, so
  (b) counts ``U_r·c`` more in that case.
  (b) *backward end*: unit gradients ``max(U_r·(c+4), U_r·c + U_max·(c+4))`` (``U_max``: largest
  non-root unit): the root's unsharded grads are reduced last; a unit being reduced holds bf16 grads
  and their reduce-scatter input in the reduce dtype (fp32: ``c+4``; ``c+r`` in general); or the
  all-gather's flat output buffer ``U_max·c``.
- optimizer step (alternative peak): the static state plus one fp32 temporary ``Ps·4`` (foreach sqrt).
- ``grad_sync_per_mini_batch`` on (:func:`defers_grad_sync`): the unsharded gradients of the whole model
  accumulate in the reduce dtype (``r`` bytes: 4 for fp32, the default; 2 with
  ``mixed_precision.reduce_dtype=bf16``) over a mini-batch's micro-batches before one reduce-scatter,
  ``P·r`` more for the whole backward (counted once even with one micro-batch per mini-batch, where
  nothing is deferred). The reduce-scatter's input is in the reduce dtype too: ``U·(c+r)`` in (b) below
  reads ``c+4`` at the default.

``log_prob`` (no grad): resident params (+ AdamW unless offloaded), gathered units as above, one layer's
forward transient ``T·c·(4h + 2·kvd + 3I)``, logits ``N·V·(c + 8)`` with ``T`` the log-prob budget.
``rollout``: resident params (+ AdamW unless offloaded) + the whole model gathered ``P·c`` + the KV
cache, which the engine sizes to fill ``gpu_memory_utilization·D``: peak ``max(util·D, resident+P·c)``.
Tensor-parallel rollout (``TP > 1``): the rank's slices ``P·c/TP`` instead of the gathered model (KV
heads, vocabulary and MLP split: each KV-cache token costs ``1/TP`` as much, so the same room holds
``TP×`` the tokens), and while resharding (before the cache exists) the send and receive buffers of the
largest unit, ``U_max·c·(1/f + 1/TP)``.
Ulysses (``sequence_parallel = S > 1``): ``T`` stays the tokens *one rank* runs (a group packs ``S·T``,
so a sequence of length ``ℓ`` costs each rank ``ℓ/S`` of every term above); KV heads fewer than ``S``
are replicated (``kvd = max(kv_heads, S)·head_dim`` in ``A``), and around attention the all-to-alls
hold q, k, v and the output once more, ``T·c·(2h + 2·kvd)`` (transient, backward start and log-prob).
One process with ``fsdp_config.plain_single_gpu`` (auto; :mod:`klppo.parallel.plain`, no FSDP2;
``Workload.plain`` and a point with ``offload="off"``, or ``"idle"`` with ``plain_single_gpu=true``:
:meth:`Workload.runs_plain`): no units, so no
gathered units, all-gather buffers or reduce-scatter inputs; resident in every phase the masters ``P·m``
(with LoRA none: a frozen weight is its own master, the adapters' are not counted)
and the compute copy ``P·c`` (+ AdamW unless offloaded; in the rollout the engine reads the compute copy:
``P·c`` once); in the update the master gradients ``P·m``, at the backward's start the terms of (a), at
its end the compute-dtype gradients ``P·c`` (:meth:`MasterWeights.accumulate_grads` drops them after
each micro-batch); no deferred gradient sync. The points' FSDP2 fields are ignored there. These terms are
not fitted to device peaks (the device points of ``tests/tune/test_memory.py`` are FSDP2's: ``plain=False``).
CUDA graphs (``cuda_graph_update``, :mod:`klppo.roles.graphed`; plain-path points with ``offload="off"``): the
actor's update and old-log-prob graphs share one pool, the larger of the two working sets, held in every
phase; the reference's graphs (``graph_reference``) a pool of one log-prob working set of their own; each
phase's
own pass is counted beside the pools (an upper bound: a shape met the first time, past ``max_graphs`` or after
a failed capture runs eagerly while the pools stay held; with every shape captured the peak is lower by
that working set). Not fitted to device peaks.
Optimizer step on the CPU (``offload="cpu_step"``, ``fsdp_config.optimizer_step_on_cpu``, plain path only,
:mod:`klppo.parallel.cpu_optim`): the masters and AdamW live on the host (``klppo.tune.host``), so the device
holds in every phase the compute copy ``P·c`` and no masters or AdamW; in the update the master gradients
``P·m`` and the terms above; the step adds nothing on the device (the chunk buffers are on the host).
A value model (``Workload.value_model``, the critic: ``klppo.tune.critic`` adds its phases and what it holds
in the actor's): the terms above with ``V = 1``.
Not modelled: the reference model (add its shards with ``reference=True``), allocator fragmentation
(``torch.cuda.max_memory_allocated`` does not count it either), CUDA context and library workspaces.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from klppo.tune.shapes import head_dim
from klppo.tune.units import WHOLE_MODEL, ModelFacts

if TYPE_CHECKING:
    from klppo.tune.critic import CriticWorkload

OFFLOAD_MODES = ("off", "idle", "cpu", "cpu_step")


@dataclass(frozen=True)
class Point:
    """One candidate setting of the actor's FSDP engine and micro-batch budget."""

    min_num_params: int
    offload: str = "off"
    """off | idle (param_offload + optimizer_offload) | cpu (FSDP2 offload_policy) | cpu_step (masters and
    AdamW on the host, stepped there: ``optimizer_step_on_cpu``, plain path only)."""
    forward_prefetch: bool = False
    reshard_after_forward: bool = True
    micro_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {self.offload!r}")


def plain_point(point: Point) -> Point:
    """``point`` as the plain path runs it (:meth:`Workload.runs_plain`): its FSDP2 fields, which do nothing
    there, at one fixed value (one unit, no forward prefetch, reshard), so that points differing only by
    them are one."""
    return dataclasses.replace(
        point, min_num_params=WHOLE_MODEL, forward_prefetch=False, reshard_after_forward=True
    )


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class Workload:
    """What does not vary over the grid: ranks, dtypes, sequence layout, rollout budget, device size."""

    world_size: int = 1
    fsdp_size: int = -1
    grad_checkpointing: bool = True
    response_fraction: float = 0.5
    """Share of a micro-batch's tokens that are response tokens (only those get logits)."""
    calculate_entropy: bool = False
    log_prob_tokens: int | None = None
    """Token budget of log-prob micro-batches (None: the point's ``micro_tokens``)."""
    gpu_memory_utilization: float = 0.5
    device_bytes: int = 80 * 2**30
    master_bytes: int = 4
    compute_bytes: int = 2
    backward_prefetch: bool = True
    reference: bool = False
    """Count a bf16 reference model's shards as resident in every phase."""
    reference_offloaded: bool = False
    """A bf16 reference kept on the host between its passes (``ref.fsdp_config.param_offload``): host memory
    (``klppo.tune.host``), nothing resident on the device."""
    lora: bool = False
    """The actor trains LoRA adapters (``actor_rollout_ref.model.lora_rank``): its peaks are
    ``klppo.tune.lora``'s, and on the host no optimizer state of the frozen weights; on the plain path
    no masters of them either."""
    value_model: bool = False
    """The model is a value model (the critic, ``klppo.tune.critic``): one output per token instead of the
    vocabulary, so its logits and head gradient are those of ``V = 1``."""
    sequence_parallel: int = 1
    """Ulysses group size S (``ulysses_sequence_parallel_size``); token counts stay per rank."""
    rollout_tensor_parallel: int = 1
    """Rollout tensor-parallel size TP (``rollout.tensor_model_parallel_size``): weights and KV per rank
    /TP."""
    grad_sync_per_mini_batch: bool | str = False
    """``fsdp_config.grad_sync_per_mini_batch`` (True, False or "auto": :func:`defers_grad_sync`)."""
    reduce_dtype: str = "float32"
    """torch dtype name of the gradient reduce-scatter (``fsdp_config.mixed_precision.reduce_dtype``)."""
    graph_update: bool = False
    """``fsdp_config.cuda_graph_update``: the actor's captured update step and old-log-prob forward keep their
    one memory pool through every phase (:func:`graph_pool_bytes`)."""
    graph_reference: bool = False
    """``ref.fsdp_config.cuda_graph_update`` (with :attr:`reference`): the reference's captured log-prob
    forward keeps a pool of its own through every phase (:func:`reference_graph_pool_bytes`)."""
    plain: bool = False
    """The actor trains without FSDP2 (:mod:`klppo.parallel.plain`) at points without ``offload_policy``: one
    process and ``fsdp_config.plain_single_gpu`` not false, resolved as the trainer does
    (:meth:`runs_plain`)."""

    plain_offload: bool = False
    """The plain path also at points that offload between phases (``offload="idle"``): only with
    ``plain_single_gpu=true`` — auto leaves offloading roles on FSDP2
    (:func:`klppo.assembly.settings.resolve_plain`)."""

    def runs_plain(self, point: Point) -> bool:
        """Whether the trainer runs ``point`` on the plain path: :attr:`plain`, no ``offload_policy``
        (``offload="cpu"`` needs FSDP2), and ``offload="idle"`` only with :attr:`plain_offload`."""
        offload = point.offload
        return self.plain and (offload in ("off", "cpu_step") or (offload == "idle" and self.plain_offload))

    def as_run(self, point: Point) -> Point:
        """``point`` as the trainer runs it: :func:`plain_point` on the plain path, else itself."""
        return plain_point(point) if self.runs_plain(point) else point

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of the gradient reduce-scatter (4 for float32, 2 for bfloat16)."""
        return _DTYPE_BYTES[self.reduce_dtype]

    def outputs(self, facts: ModelFacts) -> int:
        """Outputs per token of the model's head: ``V``, or 1 for a value model."""
        return 1 if self.value_model else facts.shape.vocab

    def kv_dim(self, facts: ModelFacts) -> int:
        """``kv_heads · head_dim`` as one rank holds K and V: replicated up to S heads under Ulysses."""
        heads = facts.shape.kv_heads
        if self.sequence_parallel > 1:
            heads = max(heads, self.sequence_parallel)
        return heads * head_dim(facts.config)

    def all_to_all_bytes(self, facts: ModelFacts, tokens: float) -> float:
        """q, k, v and the attention output held a second time around Ulysses' all-to-alls (0 for S = 1)."""
        if self.sequence_parallel <= 1:
            return 0.0
        return tokens * self.compute_bytes * (2 * facts.shape.hidden + 2 * self.kv_dim(facts))

    @property
    def shard_ranks(self) -> int:
        return self.world_size if self.fsdp_size in (-1, self.world_size) else self.fsdp_size


GRAD_SYNC_AUTO_SHARE = 0.10
"""``grad_sync_per_mini_batch=auto`` defers the sync when the unsharded gradients take at most this share of
the device."""


def defers_grad_sync(
    value: bool | str, *, ranks: int, offload: str, grad_bytes: float, device_bytes: float | None
) -> tuple[bool, str]:
    """Whether a role reduce-scatters its gradients once per mini-batch, and why. ``value``: the
    ``fsdp_config.grad_sync_per_mini_batch`` key; ``grad_bytes``: its cost (4 bytes per trainable parameter,
    the unsharded fp32 gradients, per rank); ``device_bytes`` None: no device limit (CPU).

    ``auto`` is on when there is something to save and room for it: more than one rank (one rank has no
    reduce-scatter), no offload (``offload`` of :data:`OFFLOAD_MODES` is ``off``: offload is asked for to
    save memory), and ``grad_bytes`` at most :data:`GRAD_SYNC_AUTO_SHARE` of the device."""
    if isinstance(value, bool):
        return value, "set"
    if ranks <= 1:
        return False, "auto: one rank, no gradient reduce-scatter to save"
    if offload != "off":
        return False, f"auto: offload ({offload}) puts memory first"
    if device_bytes is not None and grad_bytes > GRAD_SYNC_AUTO_SHARE * device_bytes:
        return False, (
            f"auto: unsharded gradients {grad_bytes / 2**30:.1f} GiB > {GRAD_SYNC_AUTO_SHARE:.0%} of the "
            f"device's {device_bytes / 2**30:.0f} GiB"
        )
    return True, f"auto: {ranks} ranks, unsharded gradients {grad_bytes / 2**30:.2f} GiB"


def point_defers_grad_sync(w: Workload, point: Point, num_params: float) -> bool:
    """:func:`defers_grad_sync` at a modelled point: the workload's key, ranks and device, the point's
    offload, ``num_params`` trainable parameters (the memory and communication models ask the same)."""
    deferred, _ = defers_grad_sync(
        w.grad_sync_per_mini_batch,
        ranks=w.world_size,
        offload=point.offload,
        grad_bytes=num_params * w.reduce_bytes,
        device_bytes=w.device_bytes,
    )
    return deferred


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    formula: str
    stage: str = ""
    """"": always present; otherwise the moment it belongs to (only the largest moment counts)."""


@dataclass
class PhasePeak:
    phase: str
    terms: list[Term] = field(default_factory=list)
    floor: float = 0.0
    """A lower bound on the peak set by the phase itself (rollout: the engine fills util·D)."""

    def add(self, name: str, value: float, formula: str, stage: str = "") -> None:
        self.terms.append(Term(name, float(value), formula, stage))

    def stage_bytes(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for t in self.terms:
            if t.stage:
                out[t.stage] = out.get(t.stage, 0.0) + t.bytes
        return out

    @property
    def total(self) -> float:
        """``max(floor, always-present terms + the largest stage)``."""
        always = sum(t.bytes for t in self.terms if not t.stage)
        return max(self.floor, always + max(self.stage_bytes().values(), default=0.0))


def _resident(phase: PhasePeak, facts: ModelFacts, point: Point, w: Workload, *, optimizer: bool) -> None:
    shard = math.ceil(facts.num_params / w.shard_ranks)
    if point.offload == "cpu":
        phase.add("sharded params", 0, "0 (offload_policy: shards on host)")
    elif w.lora and w.runs_plain(point):
        phase.add("sharded params", 0, "0 (plain path, LoRA: frozen weights are their own masters)")
    elif point.offload == "cpu_step":
        phase.add("sharded params", 0, "0 (optimizer_step_on_cpu: masters on host)")
    else:
        phase.add("sharded params", shard * w.master_bytes, "ceil(P/f)·m")
    if w.runs_plain(point) and phase.phase != "rollout":  # the rollout reads it as its gathered model
        phase.add("compute copy", facts.num_params * w.compute_bytes, "P·c (plain path)")
    if optimizer and point.offload == "off":
        phase.add("optimizer (AdamW)", 2 * shard * 4, "2·ceil(P/f)·4")
    if w.reference:
        phase.add("reference shards", shard * w.compute_bytes, "ceil(P/f)·c")


def _graph_pools(phase: PhasePeak, facts: ModelFacts, point: Point, w: Workload) -> None:
    """The graph pools held in ``phase``, the actor's and the reference's, in full: the phase's own pass is
    counted beside them (a micro-batch shape met the first time, one past ``max_graphs`` or after a failed
    capture runs eagerly while the pools stay held)."""
    pool = graph_pool_bytes(facts, point, w)
    if pool:
        phase.add("actor graph pool", pool, "max(update, log-prob pass) working set")
    ref_pool = reference_graph_pool_bytes(facts, point, w)
    if ref_pool:
        phase.add("reference graph pool", ref_pool, "log-prob pass working set (ref cuda_graph_update)")


def _gathered(phase: PhasePeak, facts: ModelFacts, point: Point, w: Workload, *, backward: bool) -> None:
    units = facts.units(point.min_num_params)
    c = w.compute_bytes
    inner_max = max(units.sizes[:-1], default=0)
    if units.count == 1:
        window, text = 0, "0 (root only)"
    elif point.reshard_after_forward or not backward:
        width = 2 if (point.forward_prefetch or (backward and w.backward_prefetch)) else 1
        window, text = units.largest_window(width), f"largest {width} consecutive units"
    else:
        window, text = units.total - units.root, "all units (reshard_after_forward=False)"
    # reshard_after_forward=True is passed to the root too, so the root reshards after the forward (FSDP2
    # keeps the root gathered only when the key is left unset): nothing is gathered while the loss and its
    # logits are live, and the root comes back at the head's backward (stage _HEAD)
    stage = _HEAD if backward and point.reshard_after_forward else ""
    phase.add("gathered root", units.root * c, "U_r·c", stage)
    phase.add("gathered units", window * c, f"c·({text})", stage)
    if not backward:
        phase.add("all-gather buffer", max(inner_max, units.root) * c, "U_max·c (transient)")


def update_peak(facts: ModelFacts, point: Point, w: Workload) -> PhasePeak:
    shard = math.ceil(facts.num_params / w.shard_ranks)
    phase = PhasePeak("update")
    _resident(phase, facts, point, w, optimizer=True)
    if point.offload != "cpu":
        phase.add("sharded grads", shard * w.master_bytes, "ceil(P/f)·m")
        if point.offload == "idle":
            phase.add("optimizer (AdamW)", 2 * shard * 4, "2·ceil(P/f)·4 (loaded for the update)")
    plain = w.runs_plain(point)
    if point_defers_grad_sync(w, point, facts.num_params) and not plain:
        r = w.reduce_bytes  # FSDP2 accumulates them in the reduce dtype
        phase.add("unsharded grads (sync per mini-batch)", facts.num_params * r, f"P·{r}")
    if plain:
        phase.add("compute-dtype grads", facts.num_params * w.compute_bytes, "P·c (plain path)", _END)
    else:
        _gathered(phase, facts, point, w, backward=True)
        _unit_grads(phase, facts, point, w)
    _backward_start(phase, facts, point, w)
    static = sum(t.bytes for t in phase.terms if t.name in _STATIC)
    if point.offload not in ("cpu", "cpu_step"):
        phase.floor = static + shard * 4  # optimizer step: state + one fp32 temporary
    if w.graph_update or w.graph_reference:  # held beside the update's own (possibly eager) micro-batch
        _graph_pools(phase, facts, point, w)
    return phase


def _unit_grads(phase: PhasePeak, facts: ModelFacts, point: Point, w: Workload) -> None:
    """FSDP2's backward end, (b): a unit's gradients and their reduce-scatter input."""
    c, units = w.compute_bytes, facts.units(point.min_num_params)
    inner_max = max(units.sizes[:-1], default=0)
    # with resharding the root, gathered again at the head's backward, stays gathered while the other units
    # reduce (its post-backward comes last and frees its parameters before its own reduce-scatter)
    held = units.root * c if point.reshard_after_forward and units.count > 1 else 0
    r = w.reduce_bytes  # the reduce-scatter's input, in the reduce dtype
    grads = max(
        units.root * (c + r), units.root * c + held + inner_max * (c + r), max(inner_max, units.root) * c
    )
    root_c = "2·U_r·c" if held else "U_r·c"
    phase.add(
        "unit grads / gather buffer", grads, f"max(U_r·(c+{r}), {root_c} + U_max·(c+{r}), U_max·c)", _END
    )


def _backward_start(phase: PhasePeak, facts: ModelFacts, point: Point, w: Workload) -> None:
    """(a) the backward's start and, with FSDP2 resharding the root, (c) the head's backward."""
    s, c = facts.shape, w.compute_bytes
    T, N = point.micro_tokens, point.micro_tokens * w.response_fraction
    kvd = w.kv_dim(facts)
    per_layer = 8 * s.hidden + c * (5 * s.hidden + 2 * kvd + 4 * s.intermediate)
    if w.grad_checkpointing:
        acts, text = s.layers * T * s.hidden * c + T * per_layer, "L·T·h·c + T·A"
    else:
        acts, text = s.layers * T * per_layer, "L·T·A"
    phase.add("activations", acts, text, _START)
    phase.add("backward workspace", T * c * (2 * s.hidden + 2 * s.intermediate), "T·c·(2h+2I)", _START)
    if w.sequence_parallel > 1:
        phase.add("all-to-all buffers", w.all_to_all_bytes(facts, T), "T·c·(2h+2kvd)", _START)
    V = w.outputs(facts)
    logit_bytes = c + 12 + (8 if w.calculate_entropy else 0)
    phase.add("logits", N * V * logit_bytes, f"N·V·{logit_bytes}", _START)
    phase.add("LM head grad", V * s.hidden * c, "V·h·c", _START)
    if point.reshard_after_forward and not w.runs_plain(point):  # the root gathered again (_gathered)
        phase.add("activations (head backward)", acts, text, _HEAD)
        # the logits' fp32 gradient at the head, or a layer's backward workspace just after it
        workspace = T * c * (2 * s.hidden + 2 * s.intermediate)
        phase.add("logits grad (head backward)", max(N * V * 4, workspace), "max(N·V·4, T·c·(2h+2I))", _HEAD)
        phase.add("LM head grad (head backward)", V * s.hidden * c, "V·h·c", _HEAD)


_START, _HEAD, _END = "backward start", "head backward", "backward end"
_STATIC = {"sharded params", "sharded grads", "optimizer (AdamW)", "reference shards", "compute copy"}


def _graphs_run(point: Point, w: Workload) -> bool:
    """Where the trainer captures graphs: the plain path, parameters that stay on the device."""
    return w.runs_plain(point) and point.offload == "off"


def graph_pool_bytes(facts: ModelFacts, point: Point, w: Workload) -> float:
    """What the actor's captured steps hold between their passes (``cuda_graph_update``,
    :mod:`klppo.roles.graphed`): one memory pool for the update's graphs and the old-log-prob pass's, the
    larger of their working sets — the update's peak above the resident state (activations, logits, workspace
    and gradients of one micro-batch of ``point.micro_tokens``) and :func:`forward_pool_bytes`. An estimate
    from the phases' own terms, not checked against a measured pool; 0 with graphs off, and at points
    where the trainer refuses them (graphs need the plain path and parameters that stay on the device:
    ``offload="off"``)."""
    if not (w.graph_update and _graphs_run(point, w)):
        return 0.0
    update = update_peak(facts, point, dataclasses.replace(w, graph_update=False, graph_reference=False))
    working = update.total - sum(t.bytes for t in update.terms if t.name in _STATIC)
    return max(0.0, working, forward_pool_bytes(facts, point, w))


def reference_graph_pool_bytes(facts: ModelFacts, point: Point, w: Workload) -> float:
    """The reference's captured log-prob pass's pool (``ref.fsdp_config.cuda_graph_update``):
    :func:`forward_pool_bytes`, held through every phase; 0 without graphs, a reference or where the trainer
    refuses them (the reference's plain path taken as the actor's)."""
    if not (w.graph_reference and w.reference and _graphs_run(point, w)):
        return 0.0
    return forward_pool_bytes(facts, point, w)


def forward_pool_bytes(facts: ModelFacts, point: Point, w: Workload) -> float:
    """One no-grad log-prob micro-batch's working set (its activations and logits: the log-prob phase's
    terms above the resident state), what a captured forward's pool holds."""
    phase = PhasePeak("log_prob")
    _log_prob_work(phase, facts, point, w)
    return phase.total


def log_prob_peak(facts: ModelFacts, point: Point, w: Workload) -> PhasePeak:
    """The no-grad passes' peak: one pass's working set, beside the graph pools held (a shape run eagerly
    allocates outside them)."""
    phase = PhasePeak("log_prob")
    _resident(phase, facts, point, w, optimizer=True)
    _graph_pools(phase, facts, point, w)
    if not w.runs_plain(point):
        _gathered(phase, facts, point, w, backward=False)
    _log_prob_work(phase, facts, point, w)
    return phase


def _log_prob_work(phase: PhasePeak, facts: ModelFacts, point: Point, w: Workload) -> None:
    """One log-prob micro-batch's activations (all-to-all buffers) and logits."""
    s, c = facts.shape, w.compute_bytes
    T = w.log_prob_tokens or point.micro_tokens
    N = T * w.response_fraction
    kvd = w.kv_dim(facts)
    phase.add("activations", T * c * (4 * s.hidden + 2 * kvd + 3 * s.intermediate), "T·c·(4h+2kvd+3I)")
    if w.sequence_parallel > 1:
        phase.add("all-to-all buffers", w.all_to_all_bytes(facts, T), "T·c·(2h+2kvd)")
    phase.add("logits", N * w.outputs(facts) * (c + 8), f"N·V·{c + 8}")


def rollout_peak(facts: ModelFacts, point: Point, w: Workload) -> PhasePeak:
    phase = PhasePeak("rollout")
    _resident(phase, facts, point, w, optimizer=True)
    _graph_pools(phase, facts, point, w)
    c, tp = w.compute_bytes, w.rollout_tensor_parallel
    if tp <= 1:
        phase.add("gathered model", facts.num_params * c, "P·c")
    else:
        phase.add("tensor-parallel slices", facts.num_params * c / tp, "P·c/TP")
        largest = max(facts.units(point.min_num_params).sizes)
        phase.add(
            "reshard buffers", largest * c * (1 / w.shard_ranks + 1 / tp), "U_max·c·(1/f + 1/TP)", "reshard"
        )
    used = sum(t.bytes for t in phase.terms if not t.stage)
    budget = w.gpu_memory_utilization * w.device_bytes
    # tensor parallel: the reshard buffers are freed before the engine sizes its cache (two moments)
    phase.add(
        "KV cache + workspace", max(0.0, budget - used), "util·D − the above", "generate" if tp > 1 else ""
    )
    return phase


@dataclass(frozen=True)
class TuneWorkload:
    """What the memory model needs of a run: the workload, the configured point, the sequence length."""

    workload: Workload
    point: Point
    """The actor's configured FSDP settings, micro-batch budget ``ppo_max_token_len_per_gpu``."""
    seq_len: int
    update_micro_tokens: int
    """Tokens of one update micro-batch as configured: the budget, or with fixed micro-batches rows ×
    seq_len."""
    critic: CriticWorkload | None = None
    """The critic's own workload (``klppo.tune.critic``); None: the run has no critic."""

    @property
    def update_point(self) -> Point:
        """The configured point with the update micro-batch as the trainer will run it."""
        return dataclasses.replace(self.point, micro_tokens=self.update_micro_tokens)


def predict(facts: ModelFacts, point: Point, w: Workload) -> dict[str, PhasePeak]:
    """Peaks of the three phases of one PPO step, keyed ``rollout``, ``log_prob``, ``update``."""
    return {
        "rollout": rollout_peak(facts, point, w),
        "log_prob": log_prob_peak(facts, point, w),
        "update": update_peak(facts, point, w),
    }


def peak(facts: ModelFacts, point: Point, w: Workload) -> float:
    """The largest phase peak (bytes)."""
    return max(p.total for p in predict(facts, point, w).values())


def kv_cache_room(facts: ModelFacts, point: Point, w: Workload) -> float:
    """Bytes left to the rollout KV cache (0: the rollout cannot run at this utilization)."""
    return next(t.bytes for t in rollout_peak(facts, point, w).terms if t.name == "KV cache + workspace")
