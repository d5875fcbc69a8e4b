"""Comparing the nested results (dicts, lists, tensors, numbers) that the parallel tests' workers return."""

from __future__ import annotations

import torch


def assert_same(got, want, path: str = "", *, nan_floats: bool = False) -> None:
    """Equal trees: dict keys and sequence lengths equal, tensors bit for bit (nan equal to nan, type and
    placements by ``torch.testing.assert_close``), other leaves equal; with ``nan_floats`` two nan floats
    count as equal too (a run with a nan-skipped step records its nan loss)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in want:
            assert_same(got[k], want[k], f"{path}/{k}", nan_floats=nan_floats)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]", nan_floats=nan_floats)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=path)
    elif nan_floats and isinstance(want, float) and want != want:
        assert got != got, path
    else:
        assert got == want, path
