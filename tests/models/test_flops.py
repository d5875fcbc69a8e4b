"""FLOPs per token and parameter counts against counts taken from the built modules."""

from __future__ import annotations

import pytest
import torch

from klppo.models.flops import matmul_params_per_token, model_flops_per_token, num_params
from klppo.models.tiny import build_tiny_model


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("tie", [True, False])
def test_matmul_params_equal_linear_weights(arch, tie):
    model = build_tiny_model(arch=arch, tie_word_embeddings=tie, num_kv_heads=2, num_heads=4)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params_per_token(model.config) == linear


def test_flops_formula_by_hand():
    model = build_tiny_model(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    config = model.config
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    seq = 100
    attention = 12 * 2 * 4 * 16 * seq  # 12 · L · H · d_head · S
    assert model_flops_per_token(config, seq_len=seq) == pytest.approx(6 * linear + attention)
    assert model_flops_per_token(config, seq_len=seq, training=False) == pytest.approx(
        (6 * linear + attention) / 3
    )


def test_moe_refused():
    config = build_tiny_model().config
    config.num_experts = 8
    with pytest.raises(ValueError, match="mixture-of-experts"):
        model_flops_per_token(config)


def test_num_params_counts_tied_weights_once():
    tied = build_tiny_model(tie_word_embeddings=True)
    untied = build_tiny_model(tie_word_embeddings=False)
    unique = {p.data_ptr(): p.numel() for p in tied.state_dict().values()}
    assert num_params(tied) == sum(unique.values())
    embedding = tied.get_input_embeddings().weight.numel()
    assert num_params(untied) == num_params(tied) + embedding
    assert num_params(untied, exclude_embeddings=True) == num_params(untied) - embedding
