"""Rank programs for tests/parallel/test_ulysses.py (spawned, gloo on CPU): rank 0 writes its results to
``out_dir`` and the assertions run in the pytest process against single-process float references."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from klppo.models.tiny import build_tiny_model
from klppo.parallel.mesh import build_parallel_mesh

H, T, D = 4, 6, 3  # heads, tokens per rank, head size of the all-to-all check


def all_to_all_case(sp_size: int) -> dict:
    """Inputs shared by all ranks (float64): a full [1, H, S·T, D] tensor and output-gradient weights."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, H, sp_size * T, D, generator=g, dtype=torch.float64)
    w = torch.randn(1, H // sp_size, sp_size * T, D, generator=g, dtype=torch.float64)
    return {"x": x, "w": w}


def sequences() -> tuple[torch.Tensor, torch.Tensor, int]:
    """[B, L] input ids and mask in verl's layout (left-padded prompts, right-padded responses), R."""
    g = torch.Generator().manual_seed(3)
    prompt_lens, response_lens, P, R = [5, 3, 7], [4, 6, 1], 7, 6
    ids = torch.randint(3, 300, (3, P + R), generator=g)
    mask = torch.zeros(3, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[b, P - p : P + r] = 1
    return ids * mask, mask, R


def new_policy(num_kv_heads: int) -> torch.nn.Module:
    return build_tiny_model(num_heads=4, num_kv_heads=num_kv_heads, num_layers=2, seed=0)


def new_critic(num_kv_heads: int) -> torch.nn.Module:
    from transformers import AutoModelForTokenClassification

    config = new_policy(num_kv_heads).config
    config.num_labels = 1
    torch.manual_seed(1)
    return AutoModelForTokenClassification.from_config(config).eval()  # no classifier dropout


def main(rank: int, port: int, world: int, out_dir: str, kv_heads: tuple[int, ...]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    dist.init_process_group("gloo")
    try:
        for num_kv_heads in kv_heads:
            _run(rank, world, Path(out_dir), num_kv_heads)
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, out: Path, num_kv_heads: int) -> None:
    from klppo.parallel import ulysses

    mesh = build_parallel_mesh(world, "cpu")
    sp = mesh.sequence_parallel
    results: dict = {}
    # all-to-all forward/backward in float64
    case = all_to_all_case(world)
    local = case["x"][:, :, rank * T : (rank + 1) * T].clone().requires_grad_(True)
    heads = ulysses.seq_to_heads(local, sp.group)
    (heads * case["w"]).sum().backward()
    back = ulysses.heads_to_seq(heads.detach(), sp.group)
    results["a2a"] = {"heads": heads.detach(), "grad": local.grad, "back": back}
    # model forwards with the sequence split
    ids, mask, R = sequences()
    torch.manual_seed(0)
    policy = new_policy(num_kv_heads)
    ulysses.enable_ulysses_attention(policy, sp.size)
    # activation checkpointing: the recomputed forward must get the same all-to-alls (kwargs kept)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    fused = num_kv_heads == 1  # the LM head's chunked log-prob/entropy on this variant
    if fused:
        from klppo.models.lm_head import fp32_lm_head

        fp32_lm_head(policy)
    seen = _record_tokens(policy)
    lp, ent = ulysses.forward_log_probs(
        policy,
        ids,
        mask,
        None,
        response_length=R,
        temperature=0.7,
        calculate_entropy=True,
        sp=sp,
        fused=fused,
    )
    (lp.sum() + 0.1 * ent.sum()).backward()
    results["policy"] = {"log_probs": lp.detach(), "entropy": ent.detach(), "grads": _summed_grads(policy)}
    results["tokens_seen"] = seen
    critic = new_critic(num_kv_heads)
    ulysses.enable_ulysses_attention(critic, sp.size)
    values = ulysses.forward_values(critic, ids, mask, None, response_length=R, sp=sp)
    (values**2).sum().backward()
    results["critic"] = {"values": values.detach(), "grads": _summed_grads(critic)}
    if rank == 0:
        torch.save(results, out / f"sp{world}_kv{num_kv_heads}.pt")


def _record_tokens(model: torch.nn.Module) -> dict[str, list[int]]:
    """Tokens (dim 1) entering each decoder layer, its MLP and the LM head, per call (recomputes included)."""
    seen: dict[str, list[int]] = {}

    def hook(name):
        def record(_module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            seen.setdefault(name, []).append(int(x.shape[1]))

        return record

    base = model.model
    for i, layer in enumerate(base.layers):
        layer.register_forward_pre_hook(hook(f"layer{i}"), with_kwargs=True)
        layer.mlp.register_forward_pre_hook(hook(f"mlp{i}"), with_kwargs=True)
    return seen


def _summed_grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameter gradients summed over the group (each rank holds its tokens' contributions)."""
    out = {}
    for name, p in m.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        out[name] = g
    return out
