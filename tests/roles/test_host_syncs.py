"""Host syncs of the actor's and the critic's update: a fixed number per mini-batch and per update, none
per micro-batch. Counted on CPU by what would wait for the device on a GPU: scalar reads (``.item()``,
``float(t)``, ``bool(t)``: ``aten._local_scalar_dense``), ops whose output size depends on the data
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``) and ``.tolist()`` / ``.numpy()`` /
``.cpu()`` calls.

The model code is counted too (transformers' packed-sequence detection would read one scalar per forward:
klppo's packed calls skip it). The optimizer is SGD: torch's CPU Adam reads its step counters (CUDA runs the
fused AdamW, which does not)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from klppo.batch import Batch
from klppo.batching.attention import enable_packed_attention
from klppo.models.lm_head import fp32_lm_head
from klppo.models.tiny import build_tiny_model
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.critic import Critic, CriticSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings

_DATA_DEPENDENT = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive", "is_nonzero"}


class SyncCounter(TorchDispatchMode):
    """Counts the operations that synchronise the host with the device (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: list[str] = []

    def _hit(self, name: str) -> None:
        self.count += 1
        self.names.append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" or name in _DATA_DEPENDENT:
            self._hit(name)
        elif name in ("index", "index_put", "index_put_") and _bool_index(args):
            self._hit(name + "[bool]")
        return func(*args, **(kwargs or {}))


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


@contextlib.contextmanager
def counting_syncs():
    counter = SyncCounter()
    patched = {}
    for method in ("tolist", "numpy", "cpu"):
        real = getattr(torch.Tensor, method)

        def wrapper(self, *a, _real=real, _name=method, **k):
            counter._hit(_name)
            return _real(self, *a, **k)

        patched[method] = real
        setattr(torch.Tensor, method, wrapper)
    try:
        with counter:
            yield counter
    finally:
        for method, real in patched.items():
            setattr(torch.Tensor, method, real)


def _batch(B: int = 8, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    P, R = 5, 6
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    mask = torch.ones(B, R)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    return Batch(
        prompts=torch.randint(3, 300, (B, P), generator=g),
        prompt_mask=prompt_mask,
        responses=torch.randint(3, 300, (B, R), generator=g),
        response_mask=mask,
        old_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        ref_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        advantages=torch.randn(B, R, generator=g) * mask,
        values=torch.randn(B, R, generator=g) * mask,
        returns=torch.randn(B, R, generator=g) * mask,
    )


def _actor(micro: int, rmpad: bool, fused: bool) -> Actor:
    model = build_tiny_model(seed=0)
    enable_packed_attention(model)
    fp32_lm_head(model)
    settings = ActorSettings(
        mini_batch_size=4,
        update_micro=MicroBatching(micro_batch_size=micro),
        entropy_coeff=0.01,
        use_kl_loss=True,
        use_remove_padding=rmpad,
        use_fused_kernels=fused,
    )
    return Actor(model, settings, OptimSettings(lr=1e-3, optimizer="SGD"))


def _critic(micro: int, rmpad: bool) -> Critic:
    from transformers import AutoModelForTokenClassification

    config = build_tiny_model(seed=0).config
    config.num_labels = 1
    torch.manual_seed(1)
    model = AutoModelForTokenClassification.from_config(config)
    enable_packed_attention(model)
    settings = CriticSettings(
        mini_batch_size=4, update_micro=MicroBatching(micro_batch_size=micro), use_remove_padding=rmpad
    )
    return Critic(model, settings, OptimSettings(lr=1e-3, optimizer="SGD"))


def _syncs(update, batch: Batch) -> tuple[int, list[str], dict[str, float]]:
    with counting_syncs() as counter:
        metrics = update(batch)
    return counter.count, counter.names, metrics


@pytest.mark.parametrize("rmpad", [True, False])
@pytest.mark.parametrize("role", ["actor", "actor_fused", "critic"])
def test_update_syncs_do_not_grow_with_micro_batches(role, rmpad):
    torch.set_num_threads(1)
    counts, metrics = {}, {}
    for micro in (4, 1):  # 2 mini-batches of 4 rows: 1 or 4 micro-batches each
        if role == "critic":
            update = _critic(micro, rmpad).update_critic
        else:
            update = _actor(micro, rmpad, fused=role == "actor_fused").update_policy
        counts[micro], names, metrics[micro] = _syncs(update, _batch())
        print(role, rmpad, micro, counts[micro], names)
    assert counts[1] == counts[4], (counts, names)
    # per update: the host mask (.cpu().numpy()), the epoch's row order (a CPU tensor), the metrics;
    # per mini-batch: the gradient norm with the finite flag (token counts: from the host mask, one process)
    assert sorted(names) == sorted(["cpu", "numpy", "tolist", "tolist"] + ["tolist"] * 2), names
    assert metrics[1].keys() == metrics[4].keys()


@pytest.mark.parametrize("rmpad", [True, False])
def test_forward_pass_syncs_do_not_grow_with_micro_batches(rmpad):
    torch.set_num_threads(1)
    counts, outputs = {}, {}
    for micro in (8, 1):
        actor, critic = _actor(1, rmpad, fused=False), _critic(1, rmpad)
        actor.settings = dataclasses.replace(actor.settings, log_prob_micro=MicroBatching(micro))
        critic.settings = dataclasses.replace(critic.settings, forward_micro=MicroBatching(micro))
        with counting_syncs() as counter:
            outputs[micro] = (actor.compute_log_prob(_batch()), critic.compute_values(_batch()))
        counts[micro] = counter.names
    assert counts[1] == counts[8] == ["cpu", "numpy"] * 2, counts  # one host mask per pass
    for a, b in zip(outputs[1], outputs[8]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_host_planned_packing_equals_the_device_one():
    """The packed forward planned from the host mask gives the device-planned one's log-probs, entropy,
    values and gradients exactly."""
    from klppo.batching.packing import forward_log_probs, forward_values

    torch.set_num_threads(1)
    batch = _batch()
    args = (batch.input_ids, batch.attention_mask, batch.position_ids)
    host = batch.with_host_mask().host_mask
    results = []
    for host_mask in (None, host):
        actor, critic = _actor(1, True, fused=False), _critic(1, True)
        lp, ent = forward_log_probs(
            actor.model,
            *args,
            response_length=batch.response_length,
            use_remove_padding=True,
            calculate_entropy=True,
            host_mask=host_mask,
        )
        values = forward_values(
            critic.model,
            *args,
            response_length=batch.response_length,
            use_remove_padding=True,
            host_mask=host_mask,
        )
        (lp.sum() + ent.sum() + values.sum()).backward()
        grads = [p.grad for p in [*actor.model.parameters(), *critic.model.parameters()]]
        results.append([lp, ent, values, *grads])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_device_metric_sums_equal_python_ones():
    from klppo.roles.metrics import MetricAccumulator

    g = torch.Generator().manual_seed(0)
    values, weights = torch.randn(7, generator=g), [3.0, 1.0, 7.0, 2.0, 5.0, 1.0, 4.0]
    on_host, on_device = MetricAccumulator(), MetricAccumulator()
    for v, w in zip(values, weights):
        on_host.add({"x": float(v), "c": 0.5}, weight=w)
        on_device.add({"x": v, "c": 0.5}, weight=w)
    assert on_device.means() == on_host.means()
