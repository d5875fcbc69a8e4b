"""The optimizer builder: fused AdamW on CUDA unless the config says otherwise, never on CPU."""

from __future__ import annotations

import pytest
import torch

from klppo.roles.optim import OptimSettings, build_optimizer


def _params(device: str) -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(torch.randn(4, 3, device=device)),
        torch.nn.Parameter(torch.zeros(3, device=device)),
    ]


def test_cpu_parameters_get_the_default_implementation():
    opt = build_optimizer(_params("cpu"), OptimSettings())
    assert isinstance(opt, torch.optim.AdamW) and not opt.defaults.get("fused")
    sgd = build_optimizer(_params("cpu"), OptimSettings(optimizer="SGD", extra=(("momentum", 0.5),)))
    assert not sgd.defaults.get("fused") and sgd.defaults["momentum"] == 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_parameters_get_fused_adamw_unless_overridden():
    assert build_optimizer(_params("cuda"), OptimSettings()).defaults["fused"] is True
    foreach = build_optimizer(_params("cuda"), OptimSettings(extra=(("fused", False),)))
    assert not foreach.defaults["fused"]
