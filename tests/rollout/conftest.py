"""Shared fixtures and independent references for the rollout tests."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from klppo.algorithms.sampling import truncate_logits
from klppo.models.tiny import build_tiny_model

HAS_TRITON = importlib.util.find_spec("triton") is not None


def run_triton_interpreted(source: str, timeout: float = 900) -> None:
    """Run ``source`` (which prints ``OK`` at its end) in a child process under ``TRITON_INTERPRET=1``:
    Triton kernels on the CPU through Triton's interpreter, set before triton is first imported."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def left_padded(rows: list[list[int]], pad_id: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ragged token lists into ([B, P] ids, [B, P] mask)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


def reference_log_probs(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float,
    n: int,
    *,
    top_k: int = -1,
    top_p: float = 1.0,
) -> torch.Tensor:
    """[B*n, R] log-probs of ``responses`` from one full forward of a float64 copy, row by row, unpadded;
    with ``top_k`` / ``top_p``, under the truncated, renormalised distribution."""
    model64 = copy.deepcopy(model).double().eval()
    out = torch.zeros(responses.shape, dtype=torch.float64)
    with torch.no_grad():
        for row in range(responses.shape[0]):
            p = prompts[row // n][prompt_mask[row // n].bool()]
            length = int(response_mask[row].sum())
            r = responses[row, :length]
            ids = torch.cat([p, r]).unsqueeze(0)
            logits = model64(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + length]
            lp = torch.log_softmax(truncate_logits(logits / temperature, top_k, top_p), dim=-1)
            out[row, :length] = lp.gather(-1, r.unsqueeze(-1)).squeeze(-1)
    return out


@pytest.fixture(scope="session")
def tiny_qwen2() -> torch.nn.Module:
    return build_tiny_model(arch="qwen2").eval()


@pytest.fixture(scope="session")
def prompt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded([[1, 10, 20, 30, 40, 50], [1, 7, 8], [1, 99, 100, 101, 102], [5]])
