"""The tensor-parallel layout as plain data (no process group): every rank's regions of every weight
together cover the weight once (split ones) or each hold it whole (replicated ones), KV heads replicate
when fewer than TP, and shapes that cannot split are refused naming the key."""

from __future__ import annotations

import pytest
import torch

from klppo.models.tiny import build_tiny_model
from klppo.parallel.reshard import even_split
from klppo.parallel.tp_layout import KEY, TPLayout


def test_even_split_covers_in_order():
    for n, parts in [(10, 3), (384, 2), (383, 2), (7, 7), (5, 8)]:
        ranges = [even_split(n, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [b - a for a, b in ranges]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("kv,tp", [(2, 2), (4, 2), (1, 2), (2, 4), (4, 4)])
def test_regions_tile_each_weight(kv, tp):
    model = build_tiny_model(arch="qwen2", num_heads=4, num_kv_heads=kv, vocab_size=383)
    layout = TPLayout.of(model.config, tp)
    head = 64 // 4
    for name, p in model.named_parameters():
        count = torch.zeros(p.shape, dtype=torch.long)
        for t in range(tp):
            r = layout.region(name, p.shape, t)
            if r.dim is None:
                count += 1
            else:
                count.narrow(r.dim, r.start, r.stop - r.start).add_(1)
        if ".k_proj." in name or ".v_proj." in name:
            per_rank = max(kv // tp, 1) * head
            assert all(
                layout.region(name, p.shape, t).stop - layout.region(name, p.shape, t).start == per_rank
                for t in range(tp)
            )
            assert bool((count == max(tp // kv, 1)).all()), name  # KV heads replicated when kv < tp
        elif "norm" in name or name.endswith(("o_proj.bias", "down_proj.bias")):
            assert bool((count == tp).all()), name  # whole on every rank
        else:
            assert bool((count == 1).all()), name  # split: each entry on exactly one rank


def test_query_heads_of_a_rank_share_its_kv_heads():
    """Rank t's query heads [t·H/TP, …) map to KV heads (GQA: head h uses KV head h // (H/H_kv)) inside
    the KV rows it holds."""
    for kv, tp in [(2, 2), (1, 2), (2, 4), (1, 4)]:
        layout = TPLayout(size=tp, num_heads=4, num_kv_heads=kv, head_dim=16)
        for t in range(tp):
            q = layout.region("model.layers.0.self_attn.q_proj.weight", torch.Size([64, 64]), t)
            k = layout.region("model.layers.0.self_attn.k_proj.weight", torch.Size([kv * 16, 64]), t)
            heads = range(q.start // 16, q.stop // 16)
            assert {h // (4 // kv) for h in heads} <= set(range(k.start // 16, k.stop // 16))


def test_shapes_that_cannot_split_name_the_key():
    config = build_tiny_model(num_heads=4, num_kv_heads=2).config
    with pytest.raises(ValueError, match=f"{KEY}=3 must divide num_attention_heads=4"):
        TPLayout.of(config, 3)
    config = build_tiny_model(num_heads=6, num_kv_heads=3, hidden_size=48).config
    with pytest.raises(ValueError, match="num_key_value_heads=3: one must divide the other"):
        TPLayout.of(config, 2)


def test_rollout_mesh_must_divide_the_world():
    from klppo.parallel.mesh import build_rollout_mesh

    assert build_rollout_mesh(1, "cpu") is None
    with pytest.raises(ValueError, match=f"{KEY}=2 must divide the world size 1"):
        build_rollout_mesh(2, "cpu")
