"""Compiled decoder layers over bucket-padded packed rows (klppo.models.compiled_layers): log-probs, entropy,
values and gradients equal the eager unpadded ones (fp32, 1e-5); the padding changes nothing; padded and
generation calls stay eager; the config key is checked and applied."""

from __future__ import annotations

import pytest
import torch

from klppo.batching.attention import enable_packed_attention
from klppo.batching.packing import forward_log_probs, forward_values
from klppo.models.compiled_layers import compile_packed_layers, decoder_layers, token_bucket
from klppo.models.tiny import build_tiny_model

B, P, R = 4, 5, 6


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 300, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, P + 3 :] = 0
    mask[2, P + 1 :] = 0
    return ids, mask


def _policy(*, compiled: bool = False, buckets: bool = False):
    model = build_tiny_model(seed=0)
    enable_packed_attention(model)
    if compiled:
        assert compile_packed_layers(model) == 2
    elif buckets:
        model.klppo_packed_buckets = True  # padding to the buckets, layers eager
    return model


def _critic(*, compiled: bool = False, buckets: bool = False):
    from transformers import AutoModelForTokenClassification

    config = build_tiny_model(seed=0).config
    config.num_labels = 1
    torch.manual_seed(1)
    model = AutoModelForTokenClassification.from_config(config).eval()  # no classifier dropout
    enable_packed_attention(model)
    if compiled:
        compile_packed_layers(model)
    elif buckets:
        model.klppo_packed_buckets = True
    return model


def _run(policy, critic, host: bool):
    ids, mask = _inputs()
    host_mask = mask.bool().numpy() if host else None
    lp, ent = forward_log_probs(policy, ids, mask, None, response_length=R, use_remove_padding=True,
                                calculate_entropy=True, host_mask=host_mask)  # fmt: skip
    values = forward_values(
        critic, ids, mask, None, response_length=R, use_remove_padding=True, host_mask=host_mask
    )
    (lp.sum() + 0.1 * ent.sum() + values.square().sum()).backward()
    grads = [p.grad.clone() for p in [*policy.parameters(), *critic.parameters()]]
    return [lp.detach(), ent.detach(), values.detach(), *grads]


def test_token_buckets():
    assert [token_bucket(n) for n in (1, 64, 65, 100, 129, 1000, 16384, 16385)] == [
        64, 64, 80, 112, 160, 1024, 16384, 20480,
    ]  # fmt: skip
    for n in range(1, 5000, 7):
        b = token_bucket(n)
        assert b >= n and (b <= max(64, n * 1.25))


def test_bucket_padding_changes_nothing():
    """Eager layers, packed rows padded to the bucket (the tiny batch's 35 tokens → 64): same outputs and
    gradients as unpadded, up to the float rounding of the larger matrix products."""
    torch.set_num_threads(1)
    plain = _run(_policy(), _critic(), host=True)
    padded = _run(_policy(buckets=True), _critic(buckets=True), host=True)
    for a, b in zip(plain, padded, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_compiled_layers_equal_eager():
    torch.set_num_threads(1)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager = _run(_policy(), _critic(), host=True)
    before = counters["stats"]["unique_graphs"]
    policy, critic = _policy(compiled=True), _critic(compiled=True)
    for host in (True, False, True):  # host-planned or device-planned packing: same buckets
        compiled = _run(policy, critic, host)
        for a, b in zip(eager, compiled, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        policy.zero_grad(), critic.zero_grad()
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs > 0  # the compiled code ran
    # same shapes again: nothing recompiled; a padded (non-packed) forward runs the eager layers
    _run(policy, critic, host=True)
    ids, mask = _inputs()
    policy(input_ids=ids, attention_mask=mask)
    assert counters["stats"]["unique_graphs"] - before == graphs
    assert all(getattr(layer, "klppo_compiled", False) for layer in decoder_layers(policy))


def test_config_checks_and_roles_build(tmp_path):
    from klppo.config import load_config
    from klppo.config.errors import ConfigError

    key = "actor_rollout_ref.model.compile_packed_layers=True"
    with pytest.raises(ConfigError, match="use_remove_padding=False"):
        load_config([key, "actor_rollout_ref.model.use_remove_padding=False"])
    with pytest.raises(ConfigError, match="Ulysses"):
        load_config(["critic.model.compile_packed_layers=True", "critic.model.use_remove_padding=True",
                     "critic.ulysses_sequence_parallel_size=2"])  # fmt: skip
    cfg = load_config([key])
    assert cfg.actor_rollout_ref.model.compile_packed_layers and not cfg.critic.model.compile_packed_layers

    from klppo.models.tiny import save_tiny_model_dir
    from klppo.trainer.roles_build import load_policy_model

    path = save_tiny_model_dir(tmp_path / "tiny")
    model = load_policy_model(
        cfg.actor_rollout_ref.model, str(path), torch.float32, torch.device("cpu"), train=True
    )
    assert model.klppo_packed_buckets and len(decoder_layers(model)) == 2


def test_traced_attention_compiles_each_layer_whole_with_the_same_results():
    """set_traced_packed_attention(True): the packed attention traced into the compiled layer (here the
    sdpa_block backend, the CPU's): no graph break in the layers (one region per layer call instead of
    five), and log-probs, entropy, values and gradients as the eager model's."""
    from torch._dynamo.utils import counters

    from klppo.batching.attention import set_traced_packed_attention

    torch.set_num_threads(1)
    eager = _run(_policy(), _critic(), host=True)

    def compiled_run() -> tuple[list[torch.Tensor], int, int]:
        torch._dynamo.reset()
        counters.clear()
        out = _run(_policy(compiled=True), _critic(compiled=True), host=True)
        return out, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]

    untraced, breaks_before, graphs_before = compiled_run()
    try:
        set_traced_packed_attention(True)
        traced, breaks_after, graphs_after = compiled_run()
    finally:
        set_traced_packed_attention(False)
    assert breaks_before > 0 and breaks_after == 0  # the eager attention broke every compiled layer
    assert graphs_after < graphs_before
    for a, b, c in zip(eager, untraced, traced, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
