"""The unit-choice rule of choose_units on hand-built trees with hand-counted parameters."""

from __future__ import annotations

import pytest
from torch import nn

from klppo.models.tiny import build_tiny_model
from klppo.parallel.fsdp import choose_units, unit_report


class Block(nn.Module):
    """attn: 10×10 = 100 params, mlp: 10×20 = 200 params (no biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(10, 10, bias=False)
        self.mlp = nn.Linear(10, 20, bias=False)


class Toy(nn.Module):
    """emb 50×10 = 500, 4 blocks of 300, head 10×50 = 500 (tied to emb when ``tied``): 2,200 or 2,700."""

    _no_split_modules = ["Block"]

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 10)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(10, 50, bias=False)
        if tied:
            self.head.weight = self.emb.weight


def names(model: nn.Module, units) -> list[list[str]]:
    fqn = {id(m): n or "<root>" for n, m in model.named_modules()}
    return [[fqn[id(m)] for m in unit] for unit in units]


def test_threshold_zero_one_unit_per_layer_class():
    toy = Toy()
    assert names(toy, choose_units(toy, 0, None)) == [[f"blocks.{i}"] for i in range(4)] + [["<root>"]]
    assert names(toy, choose_units(toy, 0, ["Linear"]))[:2] == [["blocks.0.attn"], ["blocks.0.mlp"]]
    with pytest.raises(ValueError, match="no module of class"):
        choose_units(toy, 0, ["Qwen2DecoderLayer"])
    plain = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="_no_split_modules"):
        choose_units(plain, 0, None)


@pytest.mark.parametrize(
    "threshold,expected",
    [
        # below one block (300): a block is never split (_no_split_modules), so one unit per block;
        # emb and head (500 each) reach it too
        (200, [["emb"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"], ["head"]]),
        # a block (300) is a unit on its own; emb/head below 301? no: 500 ≥ 300
        (300, [["emb"], ["blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3"], ["head"]]),
        # 600: two blocks per unit; emb and head (500) stay with the root
        (600, [["blocks.0", "blocks.1"], ["blocks.2", "blocks.3"]]),
        # 700: three blocks (900) close a run, the 4th (300) stays with the root
        (700, [["blocks.0", "blocks.1", "blocks.2"]]),
        # above the model size: root only
        (10_000, []),
    ],
)
def test_threshold_walk(threshold, expected):
    toy = Toy()
    assert names(toy, choose_units(toy, threshold, None)) == expected + [["<root>"]]


def test_unit_report_counts_own_params():
    toy = Toy()
    report = unit_report(choose_units(toy, 700, None))
    # unit 1: 3 blocks = 900; root: emb 500 + block 3 (300) + head 500 = 1300
    assert (report.count, report.smallest, report.largest, report.total) == (2, 900, 1300, 2200)
    report = unit_report(choose_units(toy, 200, None))
    # below a block's size: 4 blocks (300 each, never split), emb, head (500), root owns nothing
    assert (report.count, report.smallest, report.largest, report.total) == (7, 0, 500, 2200)


def test_tied_parameter_stays_with_root():
    toy = Toy(tied=True)
    units = choose_units(toy, 300, None)
    assert names(toy, units) == [[f"blocks.{i}"] for i in range(4)] + [["<root>"]]
    report = unit_report(units)
    assert (report.count, report.largest, report.total) == (5, 500, 1700)  # tied weight counted once


def test_tiny_qwen2_units():
    model = build_tiny_model(num_layers=4)
    total = sum(p.numel() for p in model.parameters())  # nn.Module.parameters() de-duplicates ties
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    report = unit_report(choose_units(model, 0, None))
    root_own = total - 4 * layer  # tied embedding/LM head + final norm
    assert (report.count, report.total, report.smallest, report.largest) == (
        5,
        total,
        min(layer, root_own),
        max(layer, root_own),
    )
    assert unit_report(choose_units(model, 2 * layer, None)).count == 3  # 2 layers per unit + root
    assert unit_report(choose_units(model, total + 1, None)).count == 1
    with pytest.raises(ValueError):
        choose_units(model, -1, None)


def test_threshold_below_a_layer_trains_with_checkpointing_and_bf16():
    """Regression: units inside a decoder layer made FSDP2 fail under activation checkpointing with bf16
    mixed precision ("aten.mm got mixed torch.Tensor and DTensor"); layers are now never split."""
    import torch

    from klppo.parallel import dist
    from klppo.parallel.fsdp import FSDPSettings, build_mesh, shard_model

    dist.init_distributed("cpu", 60.0)
    try:
        model = build_tiny_model(num_layers=2, hidden_size=64, intermediate_size=256)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        report = shard_model(
            model, FSDPSettings(min_num_params=16_000, param_dtype=torch.bfloat16), build_mesh(1, -1, "cpu")
        )
        assert report.count == 3  # 2 layers + root: nothing inside a layer
        ids = torch.randint(3, 300, (2, 12))
        model(input_ids=ids).logits.float().sum().backward()
        assert all(p.grad is not None for p in model.parameters())
    finally:
        dist.destroy()
