"""bench/sampler_chi.py on the CPU with the torch path: its rows, and a p-value that a biased sampler
fails."""

from __future__ import annotations

import json

import torch

import bench.sampler_chi as chi


def test_sampler_chi_rows_on_cpu(tmp_path) -> None:
    out = tmp_path / "chi.json"
    rows = chi.main(
        ["--sampler", "torch", "--draws", "20000", "--seeds", "2", "--device", "cpu", "--out", str(out)]
    )
    assert [(r["part"], r["t"], len(r["p"])) for r in rows] == [("chunked", 0.9, 2), ("chunked", 1.0, 2)]
    assert all(p > 0.001 for r in rows for p in r["p"])  # the torch path draws the law
    assert json.loads(out.read_text()) == rows


def test_sampler_chi_sees_a_bias(monkeypatch) -> None:
    """A sampler that halves the top token's odds gives p ≈ 0 at these draws."""

    def biased(x, params):
        x = x / params.temperature
        x[torch.arange(len(x)), x.argmax(-1)] -= 0.7
        return torch.distributions.Categorical(logits=x).sample(), None, None

    monkeypatch.setattr(chi, "sample", biased)
    rows = chi.chunked_rows("torch", 20000, 1, "cpu")
    assert all(r["p"][0] < 1e-6 for r in rows)
