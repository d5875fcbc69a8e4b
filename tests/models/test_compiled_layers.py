"""Compiled decoder layers over packed rows (klppo.models.compiled_layers), unpadded with dynamic token dims:
log-probs, entropy, values and gradients equal the eager ones (fp32, 1e-5); padded and generation calls stay
eager; the config key is checked and applied, and KLPPO_COMPILE_DYNAMIC_TOKENS refused."""

from __future__ import annotations

import pytest
import torch

from klppo.batching.attention import enable_packed_attention
from klppo.batching.packing import forward_log_probs, forward_values
from klppo.models.compiled_layers import compile_packed_layers, decoder_layers
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


def _policy(*, compiled: bool = False):
    model = build_tiny_model(seed=0)
    enable_packed_attention(model)
    if compiled:
        assert compile_packed_layers(model) == 2
    return model


def _critic(*, compiled: bool = False):
    from transformers import AutoModelForTokenClassification

    config = build_tiny_model(seed=0).config
    config.num_labels = 1
    torch.manual_seed(1)
    model = AutoModelForTokenClassification.from_config(config).eval()  # no classifier dropout
    enable_packed_attention(model)
    if compiled:
        compile_packed_layers(model)
    return model


def _run(policy, critic, host: bool):
    ids, mask = _inputs()
    host_mask = mask.bool().numpy() if host else None
    lp, ent = forward_log_probs(
        policy,
        ids,
        mask,
        None,
        response_length=R,
        use_remove_padding=True,
        calculate_entropy=True,
        host_mask=host_mask,
    )
    values = forward_values(
        critic, ids, mask, None, response_length=R, use_remove_padding=True, host_mask=host_mask
    )
    (lp.sum() + 0.1 * ent.sum() + values.square().sum()).backward()
    grads = [p.grad.clone() for p in [*policy.parameters(), *critic.parameters()]]
    return [lp.detach(), ent.detach(), values.detach(), *grads]


def test_compiled_layers_equal_eager():
    torch.set_num_threads(1)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager = _run(_policy(), _critic(), host=True)
    before = counters["stats"]["unique_graphs"]
    policy, critic = _policy(compiled=True), _critic(compiled=True)
    for host in (True, False, True):  # host-planned or device-planned packing: the same graphs
        compiled = _run(policy, critic, host)
        for a, b in zip(eager, compiled, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        policy.zero_grad(), critic.zero_grad()
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs > 0  # the compiled code ran
    assert sum(counters["graph_break"].values()) > 0  # at the compile-disabled attention
    # same shapes again: nothing recompiled; a padded (non-packed) forward runs the eager layers
    _run(policy, critic, host=True)
    ids, mask = _inputs()
    policy(input_ids=ids, attention_mask=mask)
    assert counters["stats"]["unique_graphs"] - before == graphs
    assert all(getattr(layer, "klppo_compiled", False) for layer in decoder_layers(policy))


def test_config_checks_and_roles_build(tmp_path, monkeypatch):
    from klppo.config import load_config
    from klppo.config.errors import ConfigError

    key = "actor_rollout_ref.model.compile_packed_layers=True"
    with pytest.raises(ConfigError, match="use_remove_padding=False"):
        load_config([key, "actor_rollout_ref.model.use_remove_padding=False"])
    with pytest.raises(ConfigError, match="Ulysses"):
        load_config(
            [
                "critic.model.compile_packed_layers=True",
                "critic.model.use_remove_padding=True",
                "critic.ulysses_sequence_parallel_size=2",
            ]
        )
    cfg = load_config([key])
    assert cfg.actor_rollout_ref.model.compile_packed_layers and not cfg.critic.model.compile_packed_layers

    from klppo.assembly.roles_build import load_policy_model
    from klppo.models.tiny import save_tiny_model_dir

    path = save_tiny_model_dir(tmp_path / "tiny")

    def load():
        return load_policy_model(
            cfg.actor_rollout_ref.model, str(path), torch.float32, torch.device("cpu"), train=True
        )

    model = load()
    assert len(decoder_layers(model)) == 2
    assert all(getattr(layer, "klppo_compiled", False) for layer in decoder_layers(model))
    # the variable of the static token buckets, which klppo does not have: refused at load, naming it
    for value in ("0", "1"):
        monkeypatch.setenv("KLPPO_COMPILE_DYNAMIC_TOKENS", value)
        with pytest.raises(ConfigError, match=r"compile_packed_layers=True: KLPPO_COMPILE_DYNAMIC_TOKENS"):
            load_config([key])
    load_config([])  # not compiling: the variable is not read


def _run_lengths(policy, lengths: list[int]):
    """The policy's log-probs, entropy and gradients over a packed row of ``lengths`` sequences."""
    g = torch.Generator().manual_seed(len(lengths) * 100 + sum(lengths))
    ids = torch.randint(3, 300, (len(lengths), P + R), generator=g)
    mask = (torch.arange(P + R)[None, :] < torch.tensor(lengths)[:, None]).long()
    lp, ent = forward_log_probs(
        policy,
        ids,
        mask,
        None,
        response_length=R,
        use_remove_padding=True,
        calculate_entropy=True,
        host_mask=mask.bool().numpy(),
    )
    (lp.sum() + 0.1 * ent.sum()).backward()
    out = [lp.detach(), ent.detach(), *(p.grad.clone() for p in policy.parameters() if p.requires_grad)]
    policy.zero_grad()
    return out


@pytest.mark.slow
def test_dynamic_tokens_compile_once_for_every_micro_batch_size_with_the_eager_results():
    """compile_packed_layers: no padding, the token and sequence dims dynamic —
    after the first two shapes (the second, with another token count and longest sequence, turns the
    changed sizes symbolic: the frames resumed after the eager attention and its max-length argument), new
    token counts, sequence counts and lengths compile nothing more, and every result equals the eager
    layers' (fp32, 1e-5)."""
    torch.set_num_threads(1)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager_policy, policy = _policy(), _policy()
    assert compile_packed_layers(policy) == 2
    shapes = [[11, 9, 7, 10], [10, 8], [6, 11, 11, 9, 8], [5, 3]]
    graphs = []
    for lengths in shapes:
        want = _run_lengths(eager_policy, lengths)
        got = _run_lengths(policy, lengths)
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0
    assert graphs[-1] == graphs[1]  # the third and fourth shapes: no new graph


@pytest.mark.slow
def test_dynamic_tokens_with_lora_and_gradient_checkpointing_equal_eager():
    """The compiled layers (dynamic token dims, the default) under verl's default
    enable_gradient_checkpointing=True and with LoRA adapters on every linear (peft wraps the modules inside
    the compiled layers; compile comes first, as roles_build does): the checkpointed recomputation in
    backward runs the compiled code again, and log-probs, entropy and the adapters' gradients equal the
    eager model's with the same adapters (fp32, 1e-5); a third shape compiles nothing new."""
    pytest.importorskip("peft")
    from torch._dynamo.utils import counters

    from klppo.models.lora import apply_lora

    torch.set_num_threads(1)
    torch._dynamo.reset()
    models = []
    for compiled in (False, True):
        model = _policy()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        if compiled:
            compile_packed_layers(model)
        model = apply_lora(model, rank=4, alpha=8, target_modules="all-linear")
        g = torch.Generator().manual_seed(3)  # the same non-zero adapters in both (B = 0 would hide them)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
        models.append(model)
    graphs = []
    for lengths in ([11, 9, 7, 10], [10, 8], [6, 11, 11, 9, 8]):
        want, got = _run_lengths(models[0], lengths), _run_lengths(models[1], lengths)
        assert len(want) == 2 + 2 * 2 * 7  # log-probs, entropy, A and B of 7 linears in each of 2 layers
        for a, b in zip(want, got, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[2] == graphs[1]
