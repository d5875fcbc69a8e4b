"""Compiled decoder layers over packed rows (klppo.models.compiled_layers), padded to the static token buckets
or unpadded with dynamic token dims (the default): log-probs, entropy, values and gradients equal the eager
unpadded ones (fp32, 1e-5); the padding changes nothing; padded and generation calls stay eager; the config
key and the KLPPO_COMPILE_DYNAMIC_TOKENS switch are checked and applied."""

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
    if compiled:  # the buckets (whatever KLPPO_COMPILE_DYNAMIC_TOKENS says in this shell)
        assert compile_packed_layers(model, dynamic_tokens=False) == 2
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
        compile_packed_layers(model, dynamic_tokens=False)
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
    assert sum(counters["graph_break"].values()) > 0  # at the compile-disabled attention (not traced here)
    # same shapes again: nothing recompiled; a padded (non-packed) forward runs the eager layers
    _run(policy, critic, host=True)
    ids, mask = _inputs()
    policy(input_ids=ids, attention_mask=mask)
    assert counters["stats"]["unique_graphs"] - before == graphs
    assert all(getattr(layer, "klppo_compiled", False) for layer in decoder_layers(policy))


def test_config_checks_and_roles_build(tmp_path, monkeypatch):
    from klppo.config import load_config
    from klppo.models import compiled_layers

    monkeypatch.setattr(compiled_layers, "DYNAMIC_TOKENS", None)  # the environment decides
    monkeypatch.delenv("KLPPO_COMPILE_DYNAMIC_TOKENS", raising=False)
    from klppo.config.errors import ConfigError

    key = "actor_rollout_ref.model.compile_packed_layers=True"
    with pytest.raises(ConfigError, match="use_remove_padding=False"):
        load_config([key, "actor_rollout_ref.model.use_remove_padding=False"])
    with pytest.raises(ConfigError, match="Ulysses"):
        load_config(["critic.model.compile_packed_layers=True", "critic.model.use_remove_padding=True",
                     "critic.ulysses_sequence_parallel_size=2"])  # fmt: skip
    cfg = load_config([key])
    assert cfg.actor_rollout_ref.model.compile_packed_layers and not cfg.critic.model.compile_packed_layers

    from klppo.assembly.roles_build import load_policy_model
    from klppo.models.tiny import save_tiny_model_dir

    path = save_tiny_model_dir(tmp_path / "tiny")

    def load():
        return load_policy_model(
            cfg.actor_rollout_ref.model, str(path), torch.float32, torch.device("cpu"), train=True
        )

    model = load()  # the default: dynamic token dims, no padding to the buckets
    assert not model.klppo_packed_buckets and len(decoder_layers(model)) == 2
    assert all(layer.klppo_dynamic_tokens for layer in decoder_layers(model))
    monkeypatch.setenv("KLPPO_COMPILE_DYNAMIC_TOKENS", " Off")
    model = load()  # the static buckets
    assert model.klppo_packed_buckets and not any(
        layer.klppo_dynamic_tokens for layer in decoder_layers(model)
    )
    for unset_or_on in ("yes", "", "  "):  # an empty value reads as unset
        monkeypatch.setenv("KLPPO_COMPILE_DYNAMIC_TOKENS", unset_or_on)
        assert not load().klppo_packed_buckets
    # a value that is neither: refused at load, naming the variable and the key, before any model is built
    monkeypatch.setenv("KLPPO_COMPILE_DYNAMIC_TOKENS", "2")
    with pytest.raises(ConfigError, match=r"compile_packed_layers=True: KLPPO_COMPILE_DYNAMIC_TOKENS='2'"):
        load_config([key])
    load_config([])  # not compiling: the variable is not read


def test_traced_attention_compiles_each_layer_whole_with_the_same_results():
    """set_traced_packed_attention(True): the packed attention traced into the compiled layer (here the
    sdpa_block backend, the CPU's): no graph break in the layers (the eager path breaks each one, as
    test_compiled_layers_equal_eager shows), and log-probs, entropy, values and gradients as the eager
    model's."""
    from torch._dynamo.utils import counters

    from klppo.batching.attention import set_traced_packed_attention

    torch.set_num_threads(1)
    eager = _run(_policy(), _critic(), host=True)
    torch._dynamo.reset()
    counters.clear()
    try:
        set_traced_packed_attention(True)
        traced = _run(_policy(compiled=True), _critic(compiled=True), host=True)
    finally:
        set_traced_packed_attention(False)
        torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] > 0 and sum(counters["graph_break"].values()) == 0
    for a, c in zip(eager, traced, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


def _packed_qkv(dtype, device, requires_grad=False):
    T, Hq, Hkv, D = 16, 8, 2, 16
    g = torch.Generator().manual_seed(3)
    make = lambda h: torch.randn(1, h, T, D, generator=g, dtype=torch.float32).to(device, dtype)  # noqa: E731
    q, k, v = make(Hq), make(Hkv), make(Hkv)
    for x in (q, k, v):
        x.requires_grad_(requires_grad)
    return q, k, v, torch.tensor([0, 5, 9, 16], device=device)


def test_traced_attention_equals_eager_at_a_non_default_scale():
    """sdpa_block, grouped-query heads, scaling 0.3 (not head_dim^-0.5, so a dropped scale would show)."""
    from klppo.batching.attention import packed_attention_forward, set_traced_packed_attention

    q, k, v, cu = _packed_qkv(torch.float32, "cpu")

    def attend(q, k, v, cu):
        return packed_attention_forward(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=8)[0]

    want = attend(q, k, v, cu)  # eager: the compile-disabled path
    try:
        set_traced_packed_attention(True)
        got = torch.compile(attend, backend="eager", fullgraph=True)(q, k, v, cu)  # traced: no break
    finally:
        set_traced_packed_attention(False)
        torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_traced_torch_varlen_is_one_causal_op_forward_and_backward():
    """The CUDA path (torch_varlen), traced on meta tensors: one torch_attn._varlen_attn with the causal
    window and the given scale, its registered backward likewise, gradients with the key heads' shape."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    from klppo.batching import attention
    from klppo.batching.attention import packed_attention_forward, set_packed_attention_backend

    if attention._torch_varlen() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    def attend(q, k, v, cu):
        return packed_attention_forward(None, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, max_length_q=8)[0]

    q, k, v, cu = _packed_qkv(torch.bfloat16, "meta", requires_grad=True)
    try:
        set_packed_attention_backend("torch_varlen")
        attention.set_traced_packed_attention(True)
        fn = torch.compile(attend, fullgraph=True,
                           backend=lambda gm, ex: aot_function(gm, fw_compiler=record, bw_compiler=record))  # fmt: skip
        fn(q, k, v, cu).sum().backward()
    finally:
        attention.set_traced_packed_attention(False)
        set_packed_attention_backend(None)
        torch._dynamo.reset()
    ops = [
        [n for n in g.graph.nodes if n.op == "call_function" and "varlen" in str(n.target)] for g in graphs
    ]
    (fwd,), (bwd,) = ops
    assert "_varlen_attn" in str(fwd.target) and "backward" in str(bwd.target)
    fwd_args = [a for a in fwd.args if not isinstance(a, torch.fx.Node)]
    assert 8 in fwd_args and 0.3 in fwd_args and [-1, 0] in fwd_args  # max length, scale, causal window
    assert 0.3 in [a for a in bwd.args if not isinstance(a, torch.fx.Node)]
    assert k.grad.shape == k.shape and v.grad.shape == v.shape


def _run_lengths(policy, lengths: list[int]):
    """The policy's log-probs, entropy and gradients over a packed row of ``lengths`` sequences."""
    g = torch.Generator().manual_seed(len(lengths) * 100 + sum(lengths))
    ids = torch.randint(3, 300, (len(lengths), P + R), generator=g)
    mask = (torch.arange(P + R)[None, :] < torch.tensor(lengths)[:, None]).long()
    lp, ent = forward_log_probs(policy, ids, mask, None, response_length=R, use_remove_padding=True,
                                calculate_entropy=True, host_mask=mask.bool().numpy())  # fmt: skip
    (lp.sum() + 0.1 * ent.sum()).backward()
    out = [lp.detach(), ent.detach(), *(p.grad.clone() for p in policy.parameters() if p.requires_grad)]
    policy.zero_grad()
    return out


@pytest.mark.slow
def test_dynamic_tokens_compile_once_for_every_micro_batch_size_with_the_eager_results():
    """compile_packed_layers(dynamic_tokens=True): no bucket padding, the token and sequence dims dynamic —
    after the first two shapes (the second, with another token count and longest sequence, turns the
    changed sizes symbolic: the frames resumed after the eager attention and its max-length argument), new
    token counts, sequence counts and lengths compile nothing more, and every result equals the eager
    layers' (fp32, 1e-5)."""
    torch.set_num_threads(1)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager_policy, policy = _policy(), _policy()
    assert compile_packed_layers(policy, dynamic_tokens=True) == 2
    assert not policy.klppo_packed_buckets  # no padding to the buckets
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
            compile_packed_layers(model, dynamic_tokens=True)
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
