"""Balancing across data-parallel ranks: properties, and 2 gloo ranks reproduce 1 rank."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from klppo.batching.balance import (
    balance_across_ranks,
    balance_permutation,
    inverse_permutation,
    token_imbalance,
)


@pytest.mark.parametrize("seed", range(5))
def test_balance_properties(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 4, 8])
    lens = [rng.randint(60, 1500) for _ in range(world * rng.randint(2, 16))]
    parts = balance_across_ranks(lens, world)
    assert sorted(i for p in parts for i in p) == list(range(len(lens)))
    assert all(len(p) == len(lens) // world for p in parts)
    sums = [sum(lens[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(lens)
    # Sorted lengths make the consecutive split as bad as it gets; balancing must fix that.
    ordered = sorted(lens, reverse=True)
    naive = [list(range(r * len(lens) // world, (r + 1) * len(lens) // world)) for r in range(world)]
    balanced = balance_across_ranks(ordered, world)
    assert token_imbalance(ordered, balanced) < token_imbalance(ordered, naive)
    assert token_imbalance(ordered, balanced) <= 1 + max(lens) / (sum(lens) / world)
    perm = balance_permutation(lens, world)
    chunk = len(lens) // world
    assert [sorted(perm[r * chunk : (r + 1) * chunk]) for r in range(world)] == parts
    inv = inverse_permutation(perm)
    assert [perm[i] for i in inv] == list(range(len(lens)))


def test_balance_unequal_and_errors():
    parts = balance_across_ranks([100, 1, 1, 1, 1], 2, equal_size=False)
    assert sorted(map(len, parts)) == [1, 4]
    with pytest.raises(ValueError):
        balance_across_ranks([1, 2, 3], 2)


PROMPT_LENS = [5, 2, 7, 1, 3, 6, 4, 7]
RESPONSE_LENS = [9, 1, 3, 9, 6, 2, 8, 5]
P, R = 7, 9


def _local_pass(model, ids, mask, pos, old, adv, global_tokens, global_seqs, budget):
    """Log-probs (no grad, dynamic micro-batches, packed) and the accumulated gradient of two losses."""
    from klppo.algorithms.losses import agg_loss
    from klppo.batching.dynamic import micro_batch_loss_weight, partition_by_token_budget, restore_order
    from klppo.batching.packing import forward_log_probs

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = partition_by_token_budget(mask.sum(1).tolist(), budget)
    response_mask = mask[:, P:].float()
    with torch.no_grad():
        chunks = [
            forward_log_probs(model, ids[p], mask[p], pos[p], response_length=R, use_remove_padding=True)[0]
            for p in map(torch.tensor, parts)
        ]
    log_probs = restore_order(chunks, parts)
    grads = {}
    for mode in ("token-mean", "seq-mean-token-mean"):
        model.zero_grad(set_to_none=True)
        for p in map(torch.tensor, parts):
            lp, _ = forward_log_probs(
                model, ids[p], mask[p], pos[p], response_length=R, use_remove_padding=True
            )
            loss = agg_loss(-adv[p] * torch.exp(lp - old[p]), response_mask[p], mode)
            (micro_batch_loss_weight(mode, response_mask[p], global_tokens, global_seqs, R) * loss).backward()
        grads[mode] = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
    return log_probs, grads


def _setup():
    from klppo.batching.attention import enable_packed_attention
    from klppo.models.tiny import build_tiny_model
    from tests.batching.reference import make_ragged_batch

    ids, mask, pos = make_ragged_batch(PROMPT_LENS, RESPONSE_LENS, P, R, seed=2)
    gen = torch.Generator().manual_seed(9)
    old = -5.9 + 0.2 * torch.randn(len(PROMPT_LENS), R, generator=gen)
    adv = torch.randn(len(PROMPT_LENS), R, generator=gen)
    model = build_tiny_model(seed=11)
    enable_packed_attention(model)
    return model, ids, mask, pos, old, adv


def _worker(rank, world, init_file, result_file, setup):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, ids, mask, pos, old, adv = setup  # built once in the parent, inherited through fork
        response_mask = mask[:, P:]
        global_tokens = int(response_mask.sum())
        global_seqs = int((response_mask.sum(-1) > 0).sum())
        perm = balance_permutation(mask.sum(1).tolist(), world)
        share = torch.tensor(perm).chunk(world)[rank]
        # counts each rank would all-reduce: check they rebuild the global ones
        counts = torch.tensor([response_mask[share].sum(), (response_mask[share].sum(-1) > 0).sum()])
        dist.all_reduce(counts)
        assert counts.tolist() == [global_tokens, global_seqs]
        log_probs, grads = _local_pass(
            model, ids[share], mask[share], pos[share], old[share], adv[share], global_tokens, global_seqs, 24
        )
        gathered = [None] * world
        dist.all_gather_object(gathered, (share.tolist(), log_probs))
        for g in grads.values():
            dist.all_reduce(g)  # sum over ranks: the global-token variant
        if rank == 0:
            rows = [i for idx, _ in gathered for i in idx]
            full = torch.cat([lp for _, lp in gathered])[torch.tensor(inverse_permutation(rows))]
            torch.save(
                {"log_probs": full, "grads": grads, "shares": [idx for idx, _ in gathered]}, result_file
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_ranks_reproduce_one_rank(tmp_path):
    import torch.multiprocessing as mp

    setup = _setup()
    model, ids, mask, pos, old, adv = setup
    response_mask = mask[:, P:]
    num_tokens, num_seqs = int(response_mask.sum()), int((response_mask.sum(-1) > 0).sum())
    ref_lp, ref_grads = _local_pass(model, ids, mask, pos, old, adv, num_tokens, num_seqs, 24)

    result_file = tmp_path / "result.pt"
    # fork: the children inherit the model and the imported modules (spawn would rebuild them: ~10 s)
    mp.start_processes(
        _worker,
        args=(2, str(tmp_path / "init"), str(result_file), setup),
        nprocs=2,
        join=True,
        start_method="fork",
    )
    result = torch.load(result_file)

    lens = mask.sum(1).tolist()
    shares = result["shares"]
    assert [sorted(s) for s in shares] == balance_across_ranks(lens, 2)
    assert token_imbalance(lens, shares) < 1.1
    torch.testing.assert_close(result["log_probs"], ref_lp, rtol=0, atol=2e-5)
    for mode, g in ref_grads.items():
        torch.testing.assert_close(result["grads"][mode], g, rtol=1e-4, atol=1e-6, msg=mode)
