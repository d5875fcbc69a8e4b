"""The plain path's per-step elementwise work (klppo/parallel/plain.py) with its flat buffers and per tensor
(``MasterWeights.flat`` off): kernels (CUDA; aten ops that launch one on CPU) and milliseconds of one optimizer
step's ``accumulate_grads`` × ``--micro`` and ``copy_to_model``, on a Qwen2.5-0.5B-shaped model (290
parameters, tied head; ``--narrow``: the same parameters at hidden size 64, for a CPU run). The gradients are
random (bf16, as a backward leaves them): what is measured starts after the backward.

    python -m bench.plain_flat                  # on the GPU
    python -m bench.plain_flat --narrow         # on CPU: the op counts
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen2Config, Qwen2ForCausalLM

from klppo.parallel.plain import MasterWeights
from klppo.tune.shapes import config_kwargs

CPU_KERNELS = {"aten::copy_", "aten::add_", "aten::cat", "aten::fill_"}


def measure(flat: bool, kwargs: dict, device: torch.device, micro: int) -> dict[str, tuple[int, float]]:
    """Per phase (each micro-batch's accumulation, the copy): kernels launched, milliseconds (wall, synced)."""
    MasterWeights.flat = flat
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**kwargs)).to(device)
    ms = MasterWeights(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    grads = [torch.randn_like(p) for p in ms.params]
    out = {}
    for _rep in range(2):  # the first a warm-up
        phases = [f"accumulate {i + 1}" for i in range(micro)] + ["copy_to_model"]
        for phase in phases:
            if phase.startswith("accumulate"):
                for p, g in zip(ms.params, grads):
                    p.grad = g
            cuda = device.type == "cuda"
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                torch.cuda.synchronize()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as prof:
                if cuda:
                    start.record()
                ms.accumulate_grads() if phase.startswith("accumulate") else ms.copy_to_model()
                if cuda:
                    end.record()
                    torch.cuda.synchronize()
            if cuda:
                kernels = sum(e.device_type == DeviceType.CUDA for e in prof.events())
                out[phase] = (kernels, start.elapsed_time(end))
            else:
                c = collections.Counter(e.name for e in prof.events() if e.name in CPU_KERNELS)
                out[phase] = (sum(c.values()), float("nan"))
        for m in ms.masters:  # the optimizer's zero_grad
            m.grad = None
    MasterWeights.flat = True
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--narrow", action="store_true", help="hidden size 64 (CPU)")
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per optimizer step")
    args = parser.parse_args()
    kwargs = config_kwargs("Qwen2.5-0.5B")
    if args.narrow:
        kwargs.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=512)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.narrow else "cpu")
    for flat in (False, True):
        print("flat" if flat else "per tensor")
        for phase, (kernels, ms) in measure(flat, kwargs, device, args.micro).items():
            print(f"  {phase:14s} {kernels:5d} kernels {ms:8.3f} ms")


if __name__ == "__main__":
    main()
