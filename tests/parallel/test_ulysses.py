"""Ulysses sequence parallelism on gloo: the all-to-all against a float64 reference, and 2 (and 4) ranks
splitting each packed row give the log-probs, entropy, values and parameter gradients of one process
running the whole row (fp32, 1e-5)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import ulysses_worker as W  # noqa: E402

from klppo.batching.attention import enable_packed_attention  # noqa: E402
from klppo.batching.packing import forward_log_probs, forward_values  # noqa: E402
from klppo.parallel.dist import free_port  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)


def _launch(tmp_path, world: int, kv_heads: tuple[int, ...], rank_pool=None) -> dict[int, dict]:
    """The ranks in the session's rank pool (2), or spawned for this launch (4)."""
    args = (free_port(), world, str(tmp_path), kv_heads)
    if rank_pool is not None and world <= rank_pool.size:
        rank_pool.run(W.main, *args, nprocs=world)
    else:
        mp.start_processes(W.main, args=args, nprocs=world, start_method="spawn")
    return {kv: torch.load(tmp_path / f"sp{world}_kv{kv}.pt", weights_only=False) for kv in kv_heads}


def _reference(num_kv_heads: int) -> dict:
    ids, mask, R = W.sequences()
    policy = W.new_policy(num_kv_heads)
    enable_packed_attention(policy)
    lp, ent = forward_log_probs(
        policy,
        ids,
        mask,
        None,
        response_length=R,
        temperature=0.7,
        use_remove_padding=True,
        calculate_entropy=True,
    )
    (lp.sum() + 0.1 * ent.sum()).backward()
    critic = W.new_critic(num_kv_heads)
    enable_packed_attention(critic)
    values = forward_values(critic, ids, mask, None, response_length=R, use_remove_padding=True)
    (values**2).sum().backward()
    grads = lambda m: {n: p.grad for n, p in m.named_parameters()}  # noqa: E731
    return {
        "policy": {"log_probs": lp.detach(), "entropy": ent.detach(), "grads": grads(policy)},
        "critic": {"values": values.detach(), "grads": grads(critic)},
    }


def _check_all_to_all(got: dict, world: int) -> None:
    """Rank 0's heads after the all-to-all are heads [0, H/S) of every token; its input gradient is
    the output-gradient weights of its own tokens (heads of all ranks); the inverse gives back its tokens."""
    case = W.all_to_all_case(world)
    x, w, h = case["x"], case["w"], W.H // world
    assert got["heads"].dtype == torch.float64
    torch.testing.assert_close(got["heads"], x[:, :h], rtol=0, atol=0)
    torch.testing.assert_close(got["back"], x[:, :, : W.T], rtol=0, atol=0)
    # d/dx of Σ heads·w: rank r's heads [rH/S, (r+1)H/S) are weighted by rank r's w, which every rank built
    # from the same seed, so the gradient of rank 0's tokens is w (as seen by each head's owner) on them
    want = torch.cat([w[:, :, : W.T]] * world, dim=1)
    torch.testing.assert_close(got["grad"], want, rtol=0, atol=0)


def _check_local_tokens(got: dict, world: int) -> None:
    """Outside attention a rank holds only its T'/S tokens: every decoder layer and MLP call (forward and
    the checkpointed recompute) sees ⌈T/S⌉ tokens, T the micro-batch's real tokens."""
    _ids, mask, _R = W.sequences()
    total = int(mask.sum())
    local = -(-total // world)
    assert local < total
    seen = got["tokens_seen"]
    assert set(seen) == {f"{kind}{i}" for kind in ("layer", "mlp") for i in range(2)}
    for name, counts in seen.items():
        assert counts and set(counts) == {local}, (name, counts, total)
    assert len(seen["mlp0"]) == 2  # forward + the checkpointed recompute in backward


def _check_model(got: dict, want: dict) -> None:
    for role, fields in (("policy", ("log_probs", "entropy")), ("critic", ("values",))):
        for f in fields:
            torch.testing.assert_close(got[role][f], want[role][f], **TOL, msg=f"{role} {f}")
        assert got[role]["grads"].keys() == want[role]["grads"].keys()
        for name, g in want[role]["grads"].items():
            torch.testing.assert_close(got[role]["grads"][name], g, **TOL, msg=f"{role} grad {name}")
    assert bool((want["policy"]["log_probs"] != 0).any())


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_two_ranks_match_one_process(tmp_path, rank_pool):
    """2 KV heads: one per rank; 1 KV head: replicated over the 2 ranks (and the fused LM head)."""
    runs = _launch(tmp_path, 2, (2, 1), rank_pool)
    for num_kv_heads, got in runs.items():
        _check_all_to_all(got["a2a"], 2)
        _check_local_tokens(got, 2)
        _check_model(got, _reference(num_kv_heads))


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 4, reason="4 processes on fewer than 4 cores take minutes")
def test_four_ranks_match_one_process(tmp_path):
    """4 query heads, 2 KV heads replicated to 4: one head per rank."""
    got = _launch(tmp_path, 4, (2,))[2]
    _check_all_to_all(got["a2a"], 4)
    _check_model(got, _reference(2))


def test_heads_must_split():
    from klppo.parallel.ulysses import check_heads

    check_heads(4, 2, 4)
    check_heads(4, 4, 2)
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_heads(6, 2, 4)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        check_heads(12, 3, 4)
