"""The optimizer step on the CPU (``fsdp_config.optimizer_step_on_cpu``, klppo/parallel/cpu_optim.py) against
the plain path's step on the device, on CPU: the tiny actor trained through 3 update calls (6 optimizer steps,
the clip scaling them, one call skipped for a nan loss), fp32 and bf16 compute, the step cut into several
chunks. Weights, AdamW moments and step counts within 1e-6, the next rows' log-probs too; checkpoints written
on one path resume on the other with the same state (the format does not change)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import plain_worker as W  # noqa: E402

from klppo.models.tiny import build_tiny_model  # noqa: E402
from klppo.parallel import cpu_optim  # noqa: E402
from klppo.parallel.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from klppo.parallel.cpu_optim import HostAdamW  # noqa: E402
from klppo.parallel.plain import plain_model  # noqa: E402
from klppo.roles.actor import Actor  # noqa: E402

TOL = 1e-6
FP32 = dataclasses.replace(W.SETTINGS, param_dtype=None)


def _actor(host: bool, settings) -> Actor:
    model = build_tiny_model(seed=0)
    settings = dataclasses.replace(settings, optimizer_step_on_cpu=host)
    return Actor(model, W.actor_settings(1), W.OPTIM, masters=plain_model(model, settings))


def _close(got, want, path: str = "") -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys(), path
        for k in set(want) - {"foreach", "fused"}:  # the kernels chosen for the parameters' device
            _close(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{path}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert torch.allclose(got.double(), want.double(), atol=TOL, rtol=0, equal_nan=True), path
    else:
        assert got == want or (got != got and want != want), path


@pytest.mark.parametrize("settings", [FP32, W.SETTINGS], ids=["fp32", "bf16"])
def test_cpu_step_equals_the_device_step(settings, monkeypatch):
    monkeypatch.setattr(cpu_optim, "STEP_CHUNK_BYTES", 64 * 1024)  # several chunks, and a larger parameter
    device, host = _actor(False, settings), _actor(True, settings)
    assert isinstance(host.optimizer, HostAdamW) and len(host.optimizer._chunk_list) > 2
    assert all(m.device.type == "cpu" for m in host.masters.masters)
    want = W.run_calls(device, range(3), 0, 1)
    got = W.run_calls(host, range(3), 0, 1)
    assert host.num_skipped_updates == device.num_skipped_updates == 1  # the nan call's
    for g, w in zip(got, want, strict=True):
        _close(g["log_probs"], w["log_probs"])
        assert g["lr"] == w["lr"]
        _close({k: v for k, v in g["metrics"].items()}, w["metrics"])
    _close(W.state(host), W.state(device))
    # the compute copy is the masters' cast, as the device path's copy after its step
    for p, m in zip(host.masters.params, host.masters.masters, strict=True):
        assert torch.equal(p, m.to(p.dtype))


@pytest.mark.parametrize("first", [True, False], ids=["cpu-then-device", "device-then-cpu"])
def test_checkpoint_moves_between_the_step_devices(first, tmp_path):
    writer, reader = _actor(first, FP32), _actor(not first, FP32)
    W.run_calls(writer, range(2), 0, 1)
    save_checkpoint(tmp_path / "ckpt", writer.state_model, writer.optimizer)
    load_checkpoint(tmp_path / "ckpt", reader.state_model, reader.optimizer)
    reader.scheduler.load_state_dict(writer.scheduler.state_dict())
    assert reader.optimizer.param_groups[0]["foreach"] == (None if first else True)  # its own kernel kept
    _close(W.state(reader), W.state(writer))
    for p, m in zip(reader.masters.params, reader.masters.masters, strict=True):
        assert torch.equal(p, m.to(p.dtype))  # the load refreshed the compute copy
    # and the resumed run goes on as the writer does
    after = [W.run_calls(actor, range(3, 4), 0, 1)[0]["log_probs"] for actor in (reader, writer)]
    _close(*after)
