"""The rank reshuffles of one step: with 1 process they return their input; with 2 gloo ranks the shares
cover the batch once, the gather restores rank order and the metric reduction averages."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from klppo.batch import Batch
from klppo.parallel.dist import free_port
from klppo.parallel.shares import (
    gather_samples,
    padded_share,
    reduce_metrics,
    rows_with_advantage,
    shard_for_update,
    shard_prompts,
)

N = 2  # samples per prompt


def prompts(num: int = 4) -> Batch:
    return Batch(
        prompts=torch.arange(num * 3).reshape(num, 3),
        prompt_mask=torch.ones(num, 3, dtype=torch.long),
        uid=[f"p{i}" for i in range(num)],
    )


def samples_of(mine: Batch) -> Batch:
    """What a rank's rollout and scoring would produce: per-sample fields derived from the prompt ids."""
    s = mine.repeat_interleave(N)
    lengths = torch.arange(len(s)) % 3 + 1 + s.prompts[:, 0]  # differing response lengths
    mask = (torch.arange(4)[None, :] < lengths[:, None].clamp(max=4)).float()
    return s.replace(
        responses=s.prompts[:, :1].repeat(1, 4) + 100,
        response_mask=mask,
        token_level_scores=mask * s.prompts[:, :1],
    )


def test_one_process_is_identity() -> None:
    p = prompts()
    assert shard_prompts(p) is p
    local = samples_of(p)
    batch = gather_samples(p, local, n=N, fields=("responses", "response_mask", "old_log_probs"))
    assert torch.equal(batch.responses, local.responses) and batch.old_log_probs is None
    assert batch.uid == local.uid
    assert shard_for_update(batch, balance=True) is batch
    assert reduce_metrics({"a": 1.5}) == {"a": 1.5}
    share, real = padded_share(prompts(3))
    assert real == 3 and len(share) == 3


def _worker(rank: int, port: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        p = prompts()
        mine = shard_prompts(p)
        batch = gather_samples(
            p, samples_of(mine), n=N, fields=("responses", "response_mask", "token_level_scores")
        )
        balanced = shard_for_update(batch, balance=True)
        plain = shard_for_update(batch, balance=False)
        share, real = padded_share(prompts(3))
        # actor.skip_zero_advantage_rows: rows 1, 2, 5 carry an advantage; the kept rows, padded to a
        # multiple of the 2 ranks, split into equal shares (rows tagged through old_log_probs)
        adv = torch.zeros_like(batch.response_mask)
        adv[[1, 2, 5], 0] = 1.0
        tagged = batch.replace(advantages=adv, old_log_probs=torch.arange(8.0)[:, None].expand(8, 4).clone())
        kept = rows_with_advantage(tagged.advantages, tagged.response_mask, num_shares=dist.get_world_size())
        update_share = shard_for_update(tagged.select(kept), balance=True)
        out[rank] = dict(
            kept=kept,
            update_rows=update_share.old_log_probs[:, 0].long().tolist(),
            mine=mine.uid,
            batch_responses=batch.responses,
            batch_uid=batch.uid,
            plain=plain.uid,
            balanced_tokens=float(balanced.attention_mask.sum()),
            balanced_rows=balanced.prompts[:, 0].tolist(),
            metrics=reduce_metrics({"x": float(rank), "y": 1.0}),
            padded=(share.uid, real),
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_cover_the_batch_once() -> None:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
        r0, r1 = dict(out[0]), dict(out[1])
    assert r0["mine"] == ["p0", "p1"] and r1["mine"] == ["p2", "p3"]
    whole = samples_of(prompts())
    for r in (r0, r1):  # the global batch is the one-process batch on every rank
        assert torch.equal(r["batch_responses"], whole.responses) and r["batch_uid"] == whole.uid
        assert r["metrics"] == {"x": 0.5, "y": 1.0}
    assert r0["plain"] + r1["plain"] == whole.uid
    rows = sorted(r0["balanced_rows"] + r1["balanced_rows"])
    assert rows == sorted(whole.prompts[:, 0].tolist())
    assert abs(r0["balanced_tokens"] - r1["balanced_tokens"]) <= 4  # one response's length at most
    assert r0["padded"] == (["p0", "p1"], 2) and r1["padded"] == (["p2", "p0"], 1)
    assert r0["kept"] == r1["kept"] == [0, 1, 2, 5]  # the same rows on every rank, one zero row added
    assert len(r0["update_rows"]) == len(r1["update_rows"]) == 2
    assert sorted(r0["update_rows"] + r1["update_rows"]) == [0, 1, 2, 5]
