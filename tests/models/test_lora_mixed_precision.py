"""LoRA under FSDP2 mixed precision (the GPU's settings: bf16 compute, fp32 master weights, gradients reduced
in fp32), forced on CPU in a 1-rank gloo group through the trainer's own ``shard``.

The order is the GRPO one that failed on the H200 (issue 16): the first forward through the sharded model is
the reference's, with the adapters off (the old-log-prob pass is skipped on-policy), then the actor's update.
peft's ``disable_adapter`` used to clear ``requires_grad`` on the adapters, FSDP2 took that first forward to
fix each unit's gradient dtype from its trainable parameters (none), and the first backward failed assigning
bf16 gradients to the fp32 adapters.

References are unsharded fp32 copies of the same model: the reference log-probs equal the base model's, the
adapter gradient of one step equals the fp32 one, both within bf16 rounding (relative error of a norm: a bf16
rounding is 2^-8 ≈ 4e-3 per operand; 3e-2 leaves room for the sums of a 2-layer model and no more)."""

from __future__ import annotations

import copy

import pytest
import torch

from klppo.assembly.roles_build import shard
from klppo.batch import Batch
from klppo.batching.attention import enable_packed_attention
from klppo.models.lm_head import fp32_lm_head
from klppo.models.tiny import build_tiny_model
from klppo.parallel import dist
from klppo.parallel.fsdp import FSDPSettings, gathered_params
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings
from klppo.roles.reference import Reference

pytest.importorskip("peft")

GPU_FSDP = FSDPSettings(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # fsdp_settings on cuda
BF16_REL = 3e-2


@pytest.fixture
def group():
    torch.set_num_threads(1)
    dist.init_distributed("cpu", 60.0)
    yield
    dist.destroy()


def _batch() -> Batch:
    g = torch.Generator().manual_seed(1)
    B, P, R = 4, 5, 6
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    mask = torch.ones(B, R)
    mask[1, 3:] = 0
    return Batch(
        prompts=torch.randint(3, 300, (B, P), generator=g),
        prompt_mask=prompt_mask,
        responses=torch.randint(3, 300, (B, R), generator=g),
        response_mask=mask,
        rollout_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        advantages=torch.randn(B, R, generator=g) * mask,
    )


def lora_model() -> torch.nn.Module:
    """The tiny policy as ``load_policy_model`` prepares it (fp32 master weights), with adapters whose B is
    not zero (at B = 0 the gradient of A is zero and the reference equals the actor)."""
    from klppo.models.lora import apply_lora

    model = build_tiny_model(seed=0)
    enable_packed_attention(model)
    fp32_lm_head(model)
    model = apply_lora(model, rank=4, alpha=8, target_modules="all-linear")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _roles(model: torch.nn.Module) -> tuple[Actor, Reference]:
    settings = ActorSettings(
        mini_batch_size=4,
        update_micro=MicroBatching(micro_batch_size=2),
        use_kl_loss=True,
        kl_loss_coef=0.1,
        kl_loss_type="mse",
        grad_clip=1e9,
        use_remove_padding=True,
        skip_old_log_prob_on_policy=True,
    )
    actor = Actor(model, settings, OptimSettings(lr=1.0, optimizer="SGD", weight_decay=0.0))  # change = −grad
    reference = Reference(
        model, micro=MicroBatching(micro_batch_size=4), use_remove_padding=True, adapters_off=True
    )
    return actor, reference


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 weights by name (sharded DTensors gathered)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).float().clone()
    return out


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


def test_lora_update_under_bf16_mixed_precision_matches_fp32(group):
    batch = _batch()
    model = lora_model()
    plain = copy.deepcopy(model)  # the unsharded fp32 reference
    shard(model, GPU_FSDP, torch.device("cpu"))
    actor, reference = _roles(model)
    plain_actor, plain_reference = _roles(plain)

    before = _full(model)
    ref_lp = reference.compute_ref_log_prob(batch)  # the first forward: adapters off
    want_ref = plain_reference.compute_ref_log_prob(batch)
    mask = batch.response_mask.bool()
    assert _rel(ref_lp[mask], want_ref[mask]) < BF16_REL
    assert ref_lp.dtype == torch.float32

    metrics = actor.update_policy(batch.replace(ref_log_probs=ref_lp))
    plain_actor.update_policy(batch.replace(ref_log_probs=want_ref))
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"])) and metrics["actor/grad_norm"] > 0

    after, plain_after = _full(model), _full(plain)
    adapters = [n for n in before if "lora_" in n]
    assert adapters
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name  # fp32 master weights, adapters included
        if "lora_" in name:
            assert p.requires_grad and p.grad.dtype == torch.float32, name  # reduced in fp32
    for name in before:
        step, want = before[name] - after[name], before[name] - plain_after[name]  # = gradient (SGD, lr 1)
        if "lora_" in name:
            assert want.abs().max() > 0, name
            assert _rel(step, want) < BF16_REL, (name, _rel(step, want))
        else:
            assert torch.equal(after[name], before[name]), name  # base weights frozen


def test_reference_with_adapters_off_is_the_base_model(group):
    """The reference pass under mixed precision equals the base model without adapters (fp32), and leaves
    the adapters trainable."""
    batch = _batch()
    model = lora_model()
    base = copy.deepcopy(model).unload()  # the HF model without adapters
    shard(model, GPU_FSDP, torch.device("cpu"))
    _, reference = _roles(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    got = reference.compute_ref_log_prob(batch)
    want = Reference(
        base, micro=MicroBatching(micro_batch_size=4), use_remove_padding=True
    ).compute_ref_log_prob(batch)
    mask = batch.response_mask.bool()
    assert _rel(got[mask], want[mask]) < BF16_REL
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable


def test_rollout_merge_under_mixed_precision_restores_the_base(group):
    """The merged weights the rollout engine reads are the bf16 gathered base + the adapters' delta, and
    the merge leaves neither the gathered nor the fp32 master weights changed."""
    from klppo.models.lora import merged_for_rollout

    model = lora_model()
    plain = copy.deepcopy(model)
    merged_plain = copy.deepcopy(plain).merge_and_unload().state_dict()
    shard(model, GPU_FSDP, torch.device("cpu"))
    masters = _full(model)
    with gathered_params(model):
        q = model.get_base_model().model.layers[0].self_attn.q_proj
        gathered = q.base_layer.weight.detach().clone()
        assert gathered.dtype == torch.bfloat16
        with merged_for_rollout(model) as merged:
            w = merged.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
            want = merged_plain["model.layers.0.self_attn.q_proj.weight"]
            assert w.dtype == torch.bfloat16 and _rel(w.float(), want) < 1e-2
            assert not torch.equal(w, gathered)
        assert torch.equal(q.base_layer.weight, gathered)
    after = _full(model)
    assert all(torch.equal(after[n], masters[n]) for n in masters)
