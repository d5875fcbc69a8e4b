"""What the actor and the critic share: a model with an optimizer and LR schedule, updated over
``ppo_epochs`` × mini-batches × micro-batches with gradient accumulation, clipping, and a skipped step when
the loss or the gradient norm is not finite (the rest of that batch's optimizer steps are then skipped too).

Gradients are averaged over data-parallel ranks by FSDP, so each micro-batch loss is scaled such that the
accumulated gradient equals the gradient of the loss over the *global* mini-batch (token / row counts are
all-reduced once per mini-batch): 1 rank and N ranks give the same update.

Gradient sync: by default every micro-batch's backward reduce-scatters its gradients (FSDP2's default).
With ``grad_sync_per_mini_batch`` the FSDP modules skip it (``set_requires_gradient_sync(False)``) for
every micro-batch but the last of a mini-batch: the unsharded gradients accumulate on each rank (in the
reduce dtype, fp32: 4 bytes per trainable parameter, whole model, per rank) and one reduce-scatter per
unit and mini-batch sums them; the update is the same (docs/sharding.md, "Gradient sync").

On one process without FSDP2 (``fsdp_config.plain_single_gpu``, :mod:`klppo.parallel.plain`) each
micro-batch's compute-dtype gradients are added into the fp32 master gradients after its backward, and the
clip and the optimizer step work on the masters, copied back to the model after the step: FSDP2's
arithmetic on one rank, the same update.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch.distributed.tensor import DTensor

from klppo.batch import Batch
from klppo.batching.dynamic import micro_batch_loss_weight
from klppo.parallel.collectives import all_reduce_sum_values, world_size
from klppo.parallel.fsdp import clip_grad_norm_, fsdp_modules
from klppo.parallel.local_shards import steps_on_local_shards
from klppo.parallel.plain import MasterWeights
from klppo.roles.forward import MicroBatching, iter_micro
from klppo.roles.graphed import MicroGraphs, MicroParts, signature
from klppo.roles.metrics import MetricAccumulator
from klppo.roles.oom import OOMRecovery
from klppo.roles.optim import OptimSettings, build_optimizer, build_scheduler

T = TypeVar("T")
LossTerms = list[tuple[torch.Tensor, str]]
"""A micro-batch's loss as (term, loss_agg_mode) pairs: each term is weighted by its own aggregation."""
MicroLoss = Callable[[Batch], tuple[LossTerms, dict[str, float | torch.Tensor]]]
"""Loss terms and statistics of a micro-batch; statistics may stay on the device (0-dim tensors): the
update brings them to the host once per update (:class:`klppo.roles.metrics.MetricAccumulator`)."""
GraphParts = Callable[[Batch], MicroParts]
"""A micro-batch's loss split for capture (:class:`klppo.roles.graphed.MicroParts`), built by the role."""


@dataclass(frozen=True)
class UpdateSettings:
    """The update loop's settings; sizes per rank, in samples."""

    ppo_epochs: int = 1
    mini_batch_size: int = 8
    update_micro: MicroBatching = MicroBatching(micro_batch_size=4)
    grad_clip: float = 1.0
    shuffle: bool = False
    seed: int = 1
    sp_size: int = 1  # ranks of a Ulysses group: they hold the same rows
    grad_sync_per_mini_batch: bool = False
    """Reduce-scatter gradients once per mini-batch (after its last micro-batch), not per micro-batch."""
    cuda_graph_update: bool = False
    """Each micro-batch's forward, loss and backward replayed as a CUDA graph after its shape's first two
    (:mod:`klppo.roles.graphed`), and so are the micro-batches of the role's no-grad pass (the actor's old
    log-probs, the critic's values; :attr:`TrainedRole.forward_graphs`); needs the plain path
    (``masters``)."""

    @classmethod
    def of(cls, settings: object, *, seed_offset: int = 0) -> UpdateSettings:
        """The update fields of a role's settings (same names), the shuffle seed shifted by
        ``seed_offset``."""
        fields = {
            f: getattr(settings, f)
            for f in (
                "ppo_epochs",
                "mini_batch_size",
                "update_micro",
                "grad_clip",
                "shuffle",
                "grad_sync_per_mini_batch",
                "cuda_graph_update",
            )
        }
        sp = getattr(settings, "sp", None)
        return cls(**fields, seed=settings.seed + seed_offset, sp_size=1 if sp is None else sp.size)


class TrainedRole:
    """Base of the roles that own an optimizer (actor, critic). ``name`` prefixes the metrics."""

    name = "role"

    def __init__(
        self,
        model: torch.nn.Module,
        update: UpdateSettings,
        optim: OptimSettings,
        *,
        masters: MasterWeights | None = None,
    ) -> None:
        """``masters``: the plain path's (:func:`klppo.parallel.plain.plain_model`, one process without
        FSDP2): the optimizer, the clip and the checkpoint work on the masters, the model computes."""
        self.model = model
        self.update = update
        self.masters = masters
        host = masters if masters is not None and masters.host_masters else None
        self.optimizer = build_optimizer(self.state_model.parameters(), optim, host=host)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.num_skipped_updates = 0  # optimizer steps skipped for a non-finite loss or grad norm
        self._stopped: torch.Tensor | None = None  # this update's device-side skip flag (_step_on_device)
        # out-of-memory retries with smaller micro-batches
        self.oom = OOMRecovery(self.name, sp_size=update.sp_size, update_rows=update.mini_batch_size)
        # the FSDP modules whose reduce-scatter waits for a mini-batch's last micro-batch (found once)
        self._deferred_sync = fsdp_modules(model) if update.grad_sync_per_mini_batch else []
        self.graphs: MicroGraphs | None = None
        self.forward_graphs: MicroGraphs | None = None  # the no-grad pass's (old log-probs, values)
        if update.cuda_graph_update:
            if masters is None:
                raise ValueError(
                    f"{self.name}: cuda_graph_update needs the plain path (one process, no FSDP2)"
                )
            key = f"{self.graph_key}.cuda_graph_update"
            self.graphs = MicroGraphs(list(model.parameters()), key_name=key)
            self.forward_graphs = MicroGraphs(
                (), key_name=key, what="a no-grad forward", shares_pool_with=self.graphs
            )
        self._stat_names: dict[tuple, list[str]] = {}  # per captured signature: the names of its statistics
        # graphs off: the micro-batch shapes met, to advise cuda_graph_update once when they all repeat
        self._shapes_seen: set[tuple] = set()
        self._shape_repeats = [0, 0]  # micro-batches of the current update whose shape was met before, all
        self._advised_graphs = False

    @property
    def state_model(self) -> torch.nn.Module:
        """The module whose state dict is the checkpoint's model state: the model (under FSDP2: its sharded
        master weights), or on the plain path the masters under the model's names."""
        return self.model if self.masters is None else self.masters.module

    @property
    def resident(self) -> torch.nn.Module | MasterWeights:
        """What ``param_offload`` moves: the model, on the plain path both copies."""
        return self.model if self.masters is None else self.masters

    def run_updates(
        self,
        batch: Batch,
        micro_loss: MicroLoss,
        *,
        num_mini_batches: int | None = None,
        graph_parts: GraphParts | None = None,
    ) -> dict[str, float]:
        """``ppo_epochs`` passes over mini-batches of ``batch``, one optimizer step each, then one LR step.
        Mini-batches of ``mini_batch_size`` rows, or with ``num_mini_batches`` that many equal parts of the
        batch (``actor.skip_zero_advantage_rows``: the optimizer steps of the full batch, over fewer rows;
        ``len(batch)`` must be a multiple of it). With CUDA graphs on (``self.graphs``) and ``graph_parts``
        (``micro_loss`` split for capture) each micro-batch runs through :meth:`_graphed_backward`."""
        u = self.update
        size = u.mini_batch_size
        if num_mini_batches is not None:
            if num_mini_batches < 1 or len(batch) % num_mini_batches:
                raise ValueError(
                    f"{self.name} update: {len(batch)} rows in {num_mini_batches} equal mini-batches"
                )
            size = len(batch) // num_mini_batches
        self.model.train()
        batch = batch.with_host_mask()  # micro-batches planned on the host (one copy per update)
        self._shape_repeats = [0, 0]
        self._stopped = None
        acc = MetricAccumulator()
        generator = torch.Generator().manual_seed(u.seed)
        applied = True
        for _ in range(u.ppo_epochs):
            order = (
                torch.randperm(len(batch), generator=generator) if u.shuffle else torch.arange(len(batch))
            ).tolist()
            for start in range(0, len(batch), size):
                mini = batch.select(order[start : start + size])
                applied = self._update_mini_batch(mini, micro_loss, acc, graph_parts)
                if not applied:  # non-finite: no further optimizer step from this batch
                    break
            if not applied:
                break
        if self._stopped is not None and bool(self._stopped):  # the one host read of the device's skips
            self.optimizer.zero_grad(set_to_none=True)
            self.num_skipped_updates += 1
        self._stopped = None
        self.scheduler.step()
        self._advise_graphs(batch)
        metrics = acc.means()
        metrics[f"{self.name}/lr"] = self.scheduler.get_last_lr()[0]
        metrics[f"{self.name}/num_skipped_updates"] = float(self.num_skipped_updates)
        return metrics

    def _update_mini_batch(
        self,
        mini: Batch,
        micro_loss: MicroLoss,
        acc: MetricAccumulator,
        graph_parts: GraphParts | None = None,
    ) -> bool:
        """One optimizer step on ``mini``; False (step skipped, counted) when a loss or the global gradient
        norm is not finite. Out of memory in a micro-batch (forward or backward): the
        mini-batch's gradients are dropped and it is redone with half the micro-batch (`klppo.roles.oom`);
        the accumulated gradient is the mini-batch's either way."""

        tries = 0

        def attempt(micro: MicroBatching) -> tuple[torch.Tensor, MetricAccumulator]:
            nonlocal tries
            self.optimizer.zero_grad(set_to_none=True)
            if self.masters is not None:  # a retry after out of memory: the aborted backward's gradients
                self.masters.drop_model_grads()
            if tries:  # a retry: the larger micro-batches' graphs recur no more
                self.drop_graphs()
            tries += 1
            local = MetricAccumulator()
            return self._accumulate(mini, micro_loss, local, micro, graph_parts), local

        finite, local = self.oom.run("update", self.update.update_micro, attempt, self.model)
        if self.masters is None:
            norm = clip_grad_norm_(self.model, self.update.grad_clip)
        else:
            norm = self.masters.clip_grad_norm_(self.update.grad_clip)
        acc.merge(local)
        if self._skips_on_device(finite.device):
            self._step_on_device(norm, finite)
            acc.add({f"{self.name}/grad_norm": norm})
            return True
        grad_norm, all_finite = _host_floats(norm, finite)
        acc.add({f"{self.name}/grad_norm": grad_norm})
        if all_finite and math.isfinite(grad_norm):
            self.optimizer.step()
            if self.masters is not None:
                self.masters.copy_to_model()
            return True
        self.optimizer.zero_grad(set_to_none=True)
        self.num_skipped_updates += 1
        return False

    def _skips_on_device(self, device: torch.device) -> bool:
        """Whether the optimizer step decides the skip on the device: torch's fused Adam/AdamW read a
        ``found_inf`` tensor (GradScaler's protocol) and leave the parameters, moments and step count
        untouched when it is 1, so no host read of the gradient norm is needed per mini-batch — the host
        goes on to the next mini-batch while the device finishes this one. Not other fused optimizers: torch's
        SGD with momentum stores uninitialised momentum buffers when its first step is skipped. Not with
        parameters off ``device``, where the flag lives (FSDP2's CPU offload policy with a fused CPU AdamW
        forced by ``override_optimizer_config``): torch copies the flag to the parameters' device without
        waiting for the copy, and a CPU kernel could read it before it arrives. On DTensor parameters only
        through the local-shard step (:mod:`klppo.parallel.local_shards`), which runs torch's
        kernel on plain local tensors; DTensor's own dispatch of the fused step with a flag is not used."""
        opt = self.optimizer
        local = steps_on_local_shards(opt)
        return (
            isinstance(opt, torch.optim.Adam | torch.optim.AdamW)
            and getattr(opt, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in opt.param_groups)
            and all(
                p.device == device and (local or not isinstance(p, DTensor))
                for group in opt.param_groups
                for p in group["params"]
            )
        )

    def _step_on_device(self, norm: torch.Tensor, finite: torch.Tensor) -> None:
        """The optimizer step, skipped on the device when a loss or the norm is not finite or an earlier
        mini-batch of this update was skipped (sticky: no further optimizer step from this batch, as on the
        host path; the later mini-batches still run their passes). :meth:`run_updates` reads the flag once
        at its end and counts one skip."""
        bad = ~(finite.reshape(()) & torch.isfinite(norm.detach().reshape(()).to(finite.device)))
        self._stopped = bad if self._stopped is None else self._stopped | bad
        self.optimizer.found_inf = self._stopped.float()
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.found_inf
        if self.masters is not None:
            self.masters.copy_to_model()  # unchanged masters after a skipped step: the same values

    def _accumulate(
        self,
        mini: Batch,
        micro_loss: MicroLoss,
        acc: MetricAccumulator,
        micro: MicroBatching,
        graph_parts: GraphParts | None = None,
    ) -> torch.Tensor:
        """Backward of every micro-batch of ``mini`` (gradients summed); a bool tensor on the device: every
        loss was finite. Loss weights and metric weights come from the host mask: no device sync here.
        With ``grad_sync_per_mini_batch`` only the last micro-batch's backward reduce-scatters."""
        counts = global_counts(_host_response_mask(mini), sp_size=self.update.sp_size)
        finite = torch.ones((), dtype=torch.bool, device=mini.response_mask.device)
        horizon = mini.response_length
        deferred = self._deferred_sync
        try:
            for (_, mb), last in _with_last(iter_micro(mini, micro)):
                for module in deferred:
                    module.set_requires_gradient_sync(last, recurse=False)
                mask = _host_response_mask(mb)
                if self.graphs is not None and graph_parts is not None:
                    parts = graph_parts(mb)
                    weights = [micro_weight(mode, mask, counts, horizon) for mode in parts.modes]
                    loss_finite, stats = self._graphed_backward(parts, weights)
                    finite = finite & loss_finite
                else:
                    self._note_shape(mb)
                    terms, stats = micro_loss(mb)
                    loss = sum(term * micro_weight(mode, mask, counts, horizon) for term, mode in terms)
                    finite = finite & torch.isfinite(loss)
                    loss.backward()
                if self.masters is not None:  # FSDP2's reduce into the master gradients, on one process
                    self.masters.accumulate_grads()
                acc.add(stats, weight=float(mask.sum()))
        finally:  # FSDP2's default again (also after an out-of-memory error mid-mini-batch)
            for module in deferred:
                module.set_requires_gradient_sync(True, recurse=False)
        return finite

    def drop_graphs(self) -> None:
        """Drop the update's and the no-grad pass's graphs: one memory pool between them."""
        for graphs in (self.graphs, self.forward_graphs):
            if graphs is not None:
                graphs.clear()

    graph_key = "fsdp_config"
    """Where the role's ``cuda_graph_update`` is, for the advice (the roles set their config path)."""

    def graph_capable(self) -> bool:
        """Whether the role's settings allow its updates as CUDA graphs (packed rows, …): the roles say."""
        return False

    def _note_shape(self, mb: Batch) -> None:
        """Graphs off on the plain path: count whether this micro-batch's shape (rows, columns, real tokens:
        what its packing's shapes follow) was met before."""
        if self.graphs is not None or self.masters is None or mb.host_mask is None or self._advised_graphs:
            return
        shape = (*mb.host_mask.shape, int(mb.host_mask.sum()))
        self._shape_repeats[0] += shape in self._shapes_seen
        self._shape_repeats[1] += 1
        self._shapes_seen.add(shape)

    def _advise_graphs(self, batch: Batch) -> None:
        """Once per run, on a GPU: every micro-batch of this update had a shape met before — the case
        ``cuda_graph_update`` serves (docs/sharding.md)."""
        repeated, total = self._shape_repeats
        if self._advised_graphs or not total or repeated < total or not _on_gpu(batch):
            return
        if not self.graph_capable():
            return
        self._advised_graphs = True
        logging.getLogger("klppo").info(
            "advice: %s: every update micro-batch repeats a shape met before: %s.cuda_graph_update=true "
            "replays them and the role's no-grad pass as CUDA graphs (the reference's pass with "
            "actor_rollout_ref.ref.fsdp_config.cuda_graph_update; docs/sharding.md, 'The update as CUDA "
            "graphs')",
            self.name,
            self.graph_key,
        )

    def _graphed_backward(
        self, parts: MicroParts, weights: list[float]
    ) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """One micro-batch's forward, weighted loss and backward through :attr:`graphs` (eager, captured or
        replayed): the loss's terms weighted as in :meth:`_accumulate`, the weights 0-dim float32 tensors (the
        same products as the Python floats give). Returns (loss finite, statistics) read at once, as a
        replay's outputs must be; ``parts.host_stats`` added as they are."""
        device = parts.tensors[0].device
        scales = [torch.full((), w, dtype=torch.float32, device=device) for w in weights]
        n, names = len(parts.tensors), []

        def step(ts):
            terms, stats = parts.loss(ts[:n])
            if [mode for _, mode in terms] != parts.modes:
                raise AssertionError(
                    f"{self.name}: loss terms {[m for _, m in terms]}, declared {parts.modes}"
                )
            loss = sum(term * scale for (term, _), scale in zip(terms, ts[n:], strict=True))
            loss.backward()
            names[:] = sorted(stats)
            return [torch.isfinite(loss), *(stats[k] for k in names)]

        key = signature(parts.tensors, extra=(parts.key, tuple(parts.modes)))
        outputs = self.graphs.run(key, [*parts.tensors, *scales], step)
        if names:
            self._stat_names[key] = list(names)
        stats = dict(zip(self._stat_names[key], outputs[1:], strict=True))
        return outputs[0], {**stats, **parts.host_stats}

    # ---- checkpoint state ---------------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "num_skipped_updates": self.num_skipped_updates}

    def load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.num_skipped_updates = int(state["num_skipped_updates"])


def global_counts(mini_mask, *, sp_size: int = 1) -> tuple[float, float, float]:
    """(tokens, rows with a token, rows) of the mini-batch summed over the data-parallel groups: one
    collective over all ranks (none on one), divided by ``sp_size`` (the ranks of a Ulysses group hold the
    same rows). ``mini_mask``: the host (numpy) response mask, or a device tensor (one read)."""
    if isinstance(mini_mask, torch.Tensor):
        local = torch.stack([mini_mask.sum(), (mini_mask.sum(dim=-1) > 0).sum()]).double().tolist()
    else:
        local = [float(mini_mask.sum()), float((mini_mask.sum(-1) > 0).sum())]
    tokens, seqs, num_rows = all_reduce_sum_values([*local, float(mini_mask.shape[0])])
    return tokens / sp_size, seqs / sp_size, num_rows / sp_size


def _with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """``(item, is_last)`` pairs, one item ahead (micro-batches stay lazy)."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


def _host_response_mask(mb: Batch):
    """The tokens the micro-batch's losses count, ``response_mask``: on the host (numpy,
    :attr:`Batch.host_loss_mask`) when the batch has its host copies, else the device tensor. Not the
    attention: appended tool tokens and rejected tokens are attended to but weigh nothing."""
    host = mb.host_loss_mask
    return mb.response_mask if host is None else host


def _on_gpu(batch: Batch) -> bool:
    return batch.response_mask.is_cuda


def _host_floats(grad_norm: torch.Tensor, finite: torch.Tensor) -> tuple[float, bool]:
    """(gradient norm, every loss finite) on the host, in one device→host transfer."""
    norm = grad_norm.detach().reshape(()).double().to(finite.device)
    value, ok = torch.stack([norm, finite.double()]).tolist()
    return value, ok == 1.0


def micro_weight(mode: str, micro_mask, counts: tuple[float, float, float], horizon: int) -> float:
    """Scale of a micro-batch's aggregated loss so that the sum over micro-batches and ranks (FSDP averages
    gradients over the ranks, hence × world size) equals the aggregated loss of the global mini-batch.
    With Ulysses groups of S ranks each rank's gradient is its tokens' share of its group's loss, the S
    shares sum to the group's gradient, and × world size (= dp × S) still undoes FSDP's average."""

    tokens, seqs, rows = counts
    return world_size() * micro_batch_loss_weight(
        mode, micro_mask, tokens, seqs, horizon=horizon, mini_num_rows=rows
    )
