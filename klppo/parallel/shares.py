"""How one step's rows move between the data-parallel ranks, as named functions.

A step's prompts are the same on every rank; each rank rolls out its contiguous share (all samples of a
prompt stay on one rank), the per-sample fields are gathered into the global batch (identical on every
rank, in rank order), and each rank updates on its share of that batch. Metrics computed per rank are
averaged in one collective. With one rank every function returns its input.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from klppo.batch import Batch
from klppo.batching.balance import balance_across_ranks
from klppo.parallel.collectives import all_gather_rows, all_reduce_sum, group_all_gather, rank, world_size
from klppo.parallel.dist import phase


def shard_prompts(prompts: Batch) -> Batch:
    """This rank's contiguous share of the step's prompts (sizes are checked divisible at start)."""
    w = world_size()
    if w == 1:
        return prompts
    return prompts.chunk(w)[rank()]


def padded_share(batch: Batch) -> tuple[Batch, int]:
    """This rank's rows of ``batch`` when they may not divide evenly (validation): every rank gets
    ceil(n / world) rows, the missing ones filled with copies of row 0, so every rank runs the same
    collectives; returns (rows, number of real rows)."""
    w, r, n = world_size(), rank(), len(batch)
    per = -(-n // w)
    real = list(range(min(r * per, n), min((r + 1) * per, n)))
    return batch.select(real + [0] * (per - len(real))), len(real)


def gather_samples(prompts: Batch, local: Batch, *, n: int, fields: Sequence[str]) -> Batch:
    """The global batch: the step's ``prompts`` × ``n`` with every rank's per-sample tensor ``fields``
    (those set on ``local``, this rank's samples of :func:`shard_prompts`) concatenated in rank order."""
    batch = prompts.repeat_interleave(n)
    with phase("gather_samples"):  # a rank stuck before this point shows here on the others
        for name in fields:
            value = getattr(local, name)
            if value is not None:
                setattr(batch, name, all_gather_rows(value))
    return batch


def shard_for_update(batch: Batch, *, balance: bool, sp_size: int = 1) -> Batch:
    """This rank's samples of the global batch for the updates: a contiguous share, or with ``balance``
    (``trainer.balance_batch``) equal token counts per share. One share per data-parallel group of
    ``sp_size`` consecutive ranks (a Ulysses group, see :mod:`klppo.parallel.mesh`: its ranks get the same
    share); ``sp_size`` 1: one per rank."""
    w, r = world_size() // sp_size, rank() // sp_size
    if w == 1:
        return batch
    if balance:
        lengths = batch.attention_mask.sum(dim=1).long().tolist()
        return batch.select(balance_across_ranks(lengths, w)[r])
    return batch.chunk(w)[r]


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Mean over ranks of the per-rank metrics (one collective for all keys; every rank has the same keys)."""
    if world_size() == 1:
        return metrics
    keys = sorted(metrics)
    with phase("reduce_metrics"):
        values = all_reduce_sum(torch.tensor([metrics[k] for k in keys], dtype=torch.float64)) / world_size()
    return dict(zip(keys, values.tolist()))


def rows_with_advantage(
    advantages: torch.Tensor, response_mask: torch.Tensor, *, num_shares: int
) -> list[int]:
    """The rows the actor update keeps with ``actor.skip_zero_advantage_rows``: every row with a nonzero
    advantage at some response token, then as few zero-advantage rows (in row order) as make the count a
    multiple of ``num_shares`` — the data-parallel shares must be equal. All rows when none has an
    advantage (the update is then the KL and entropy terms of the whole batch, as without the option).
    Ascending row indices."""
    nonzero = ((advantages != 0) & response_mask.bool()).any(dim=1).cpu()
    keep = torch.nonzero(nonzero).flatten().tolist()
    if not keep:
        return list(range(len(nonzero)))
    target = min(len(nonzero), -(-len(keep) // num_shares) * num_shares)
    if len(keep) < target:
        keep = sorted(keep + torch.nonzero(~nonzero).flatten().tolist()[: target - len(keep)])
    return keep


def group_rows(
    prompts: torch.Tensor, prompt_mask: torch.Tensor, group: dist.ProcessGroup, *, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A rollout tensor-parallel group's prompts and mask in rank order, [G·B, P'] left-padded to the
    longest (every rank of ``group`` brings the same B)."""
    comm = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    shapes = group_all_gather(torch.tensor(prompts.shape, device=comm), group).tolist()
    if len({b for b, _ in shapes}) != 1:
        raise ValueError(
            f"the ranks of a rollout tensor-parallel group hold different prompt counts {shapes}"
        )
    width = max(p for _, p in shapes)
    pad = width - prompts.shape[1]
    ids = F.pad(prompts, (pad, 0), value=pad_id).to(comm)
    mask = F.pad(prompt_mask, (pad, 0), value=0).to(comm)
    all_ids = group_all_gather(ids, group).flatten(0, 1)
    all_mask = group_all_gather(mask, group).flatten(0, 1)
    return all_ids.to(prompts.device), all_mask.to(prompts.device)
