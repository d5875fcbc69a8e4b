"""The non-finite skip decided on the device (klppo/roles/trained.py ``_step_on_device``): with a fused
Adam/AdamW the optimizer reads a ``found_inf`` flag instead of the host reading the gradient norm per
mini-batch. Against the host's decision, on the plain path with fused AdamW on CPU, over update calls with
a nan advantage (a non-finite loss) and an infinite gradient (a finite loss): the same weights, AdamW
moments and step counts bit for bit after every call, the same skip counts, learning rates and next-row
log-probs; the metrics of calls without a skip are equal too (a skipped call's differ: the device path
still runs the mini-batches after the skipped one, without stepping)."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))
import plain_worker as W  # noqa: E402
from tree_compare import assert_same  # noqa: E402

from klppo.models.tiny import build_tiny_model  # noqa: E402
from klppo.parallel.plain import plain_model  # noqa: E402
from klppo.roles.actor import Actor  # noqa: E402
from klppo.roles.optim import OptimSettings  # noqa: E402

FUSED = dataclasses.replace(W.OPTIM, extra=(("fused", True),))
INF_LOSS_CALL = (
    4  # this call's losses are infinite by a constant, their gradients finite: skipped for the loss
)
SKIPPED_CALLS = (W.NAN_CALL, W.INF_CALL, INF_LOSS_CALL)
CPU = torch.device("cpu")


def _infinite_loss(actor: Actor):
    """The actor's micro-batch loss plus an infinite constant (no gradient): the gradient norm stays
    finite."""
    real = actor._micro_loss

    def micro_loss(mb, *args):
        (first, mode), *rest = (terms := real(mb, *args))[0]
        return [(first + torch.tensor(float("inf")), mode), *rest], terms[1]

    return micro_loss


def _run(on_device: bool, monkeypatch) -> tuple[list[dict], list[dict], Actor]:
    model = build_tiny_model(seed=0)
    actor = Actor(model, W.actor_settings(1), FUSED, masters=plain_model(model, W.SETTINGS))
    assert actor._skips_on_device(CPU)
    if not on_device:  # the oracle: the host reads the norm and decides (the path of unfused optimizers)
        monkeypatch.setattr(actor, "_skips_on_device", lambda device: False)
    states = []
    calls = []
    for call in range(W.CALLS):
        if call == INF_LOSS_CALL:
            actor._micro_loss = _infinite_loss(actor)  # run_calls drops it after the update
        calls += W.run_calls(actor, range(call, call + 1), 0, 1)
        states.append(W.state(actor))
    return calls, states, actor


def test_device_skip_equals_the_host_decision(monkeypatch):
    host_calls, host_states, host = _run(False, monkeypatch)
    dev_calls, dev_states, dev = _run(True, monkeypatch)
    assert host.num_skipped_updates == dev.num_skipped_updates == 3
    for call, (h, d) in enumerate(zip(host_calls, dev_calls, strict=True)):
        assert_same(d["log_probs"], h["log_probs"])
        assert d["lr"] == h["lr"]
        assert_same(dev_states[call], host_states[call])
        if call in SKIPPED_CALLS:
            skipped = d["metrics"]["actor/num_skipped_updates"]
            assert skipped == h["metrics"]["actor/num_skipped_updates"]
            # a non-finite norm, or (the infinite-loss call) a finite norm with a non-finite loss
            assert math.isfinite(d["metrics"]["actor/grad_norm"]) == (call == INF_LOSS_CALL)
        else:
            assert_same(d["metrics"], h["metrics"], nan_floats=True)
    # the skips did happen: the steps between the calls moved the weights, the skipped calls did not
    moved = [
        not torch.equal(a["model"]["model.embed_tokens.weight"], b["model"]["model.embed_tokens.weight"])
        for a, b in zip(dev_states, dev_states[1:])
    ]
    assert moved == [call + 1 not in SKIPPED_CALLS for call in range(W.CALLS - 1)]


def test_non_fused_optimizers_keep_the_host_decision():
    model = build_tiny_model(seed=0)
    actor = Actor(model, W.actor_settings(1), W.OPTIM, masters=plain_model(model, W.SETTINGS))
    assert not actor._skips_on_device(CPU)  # foreach AdamW (CPU default) takes no found_inf


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_adamw_on_cuda_skips_with_found_inf():
    p = torch.nn.Parameter(torch.ones(4, device="cuda"))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.full_like(p, float("nan"))
    opt.found_inf = torch.ones((), device="cuda")
    opt.step()
    del opt.found_inf
    assert torch.equal(p.detach(), torch.ones_like(p)) and opt.state[p]["step"].item() == 0
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["step"].item() == 1 and (p.detach() < 1).all()


def test_fused_sgd_keeps_the_host_decision():
    """torch's fused SGD takes ``found_inf`` too, but a skipped first step stores its momentum buffers
    uninitialised (``torch.empty_like``) and the next step reads them: only Adam/AdamW skip on the device."""
    model = build_tiny_model(seed=0)
    sgd = OptimSettings(lr=0.1, optimizer="SGD", extra=(("fused", True), ("momentum", 0.9)))
    actor = Actor(model, W.actor_settings(1), sgd, masters=plain_model(model, W.SETTINGS))
    assert actor.optimizer._step_supports_amp_scaling
    assert not actor._skips_on_device(CPU)


def test_parameters_off_the_flags_device_keep_the_host_decision():
    """Parameters on the CPU while the batch (and the flag) is on the GPU — FSDP2's CPU offload policy with
    a fused AdamW forced: torch would copy the flag without waiting, so the host decides."""
    model = build_tiny_model(seed=0)
    actor = Actor(model, W.actor_settings(1), FUSED, masters=plain_model(model, W.SETTINGS))
    assert actor._skips_on_device(CPU)
    assert not actor._skips_on_device(torch.device("cuda", 0))


def test_dtensor_parameters_skip_on_the_device_only_through_the_local_shard_step(monkeypatch):
    """DTensor parameters (FSDP2): the device path only with the local-shard step, which runs torch's fused
    kernel on plain local tensors; DTensor's own dispatch of the fused step with a flag is not relied on.
    Every parameter stands in for a DTensor here (no process group needed)."""
    from klppo.parallel.local_shards import LocalShardAdamW
    from klppo.roles import trained

    monkeypatch.setattr(trained, "DTensor", torch.nn.Parameter)
    model = build_tiny_model(seed=0)
    actor = Actor(model, W.actor_settings(1), FUSED, masters=plain_model(model, W.SETTINGS))
    assert isinstance(actor.optimizer, LocalShardAdamW)  # the default (local_shard_optim)
    assert actor._skips_on_device(CPU)
    plain = Actor(build_tiny_model(seed=0), W.actor_settings(1), FUSED, masters=None)
    plain.optimizer = torch.optim.AdamW(plain.model.parameters(), lr=1e-3, fused=True)
    assert not plain._skips_on_device(CPU)
