"""Seven billion parameters on one GPU (issue 53): the fixed workload, built through klppo's trainer.

Qwen2.5-7B shape with random weights, 64 prompts × 8 responses of 512 prompt + 512 response tokens
(responses forced to length with ``rollout.ignore_eos``), one mini-batch of 64 prompts per step (on-policy,
one update), GRPO with a k3 KL loss (``low_var_kl``; actor + reference); ``--critic``: GAE with a critic
(PPO: actor, reference, critic); ``--lora 64``: LoRA rank 64 (the reference is the actor with adapters off).
The run's settings are the recipe's (``examples/qwen7b_grpo_one_gpu.yaml``): the optimizer step on the CPU
(``fsdp_config.optimizer_step_on_cpu``), gradient checkpointing, the reference offloaded between its passes;
``--set key=value`` changes any of them.

Prints per step the phase times, and at the end one JSON line: the median over the steps after the first of
each phase time, tokens/s (verl's ``perf/throughput``: (prompt + response tokens) / step time, per GPU),
the update's MFU (``perf/mfu/actor``), and the memory model's predicted peaks beside the measured ones — the
device's (``torch.cuda.max_memory_allocated``, the largest phase predicted) and the host's (peak RSS,
``klppo.tune.host``).

    PYTHONPATH=$PWD python3 bench/seven_b.py --steps 4 --out $OUT/grpo.json          # (a) GRPO
    PYTHONPATH=$PWD python3 bench/seven_b.py --steps 4 --critic --out $OUT/ppo.json  # (b) PPO with a critic
    PYTHONPATH=$PWD python3 bench/seven_b.py --device cpu --tiny --steps 2           # smoke test
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ppo_step import (  # noqa: E402
    ARR,
    Workload,
    base_overrides,
    make_model_dir,
    make_prompts,
    run_trainer,
    tiny_workload,
)
from klppo.tune.shapes import config_kwargs  # noqa: E402

QWEN25_7B = config_kwargs("Qwen2.5-7B")
RECIPE = [  # what the memory model says fits one 80 GiB GPU (examples/qwen7b_grpo_one_gpu.yaml)
    f"{ARR}.actor.fsdp_config.optimizer_step_on_cpu=True",
    f"{ARR}.ref.fsdp_config.param_offload=True",
    f"{ARR}.actor.use_dynamic_bsz=True",
    f"{ARR}.actor.ppo_max_token_len_per_gpu=8192",
    f"{ARR}.rollout.log_prob_max_token_len_per_gpu=8192",
    f"{ARR}.ref.log_prob_max_token_len_per_gpu=8192",
    f"{ARR}.model.use_remove_padding=True",
    f"{ARR}.model.use_fused_kernels=True",
]
GRPO = [
    "algorithm.adv_estimator=grpo",
    f"{ARR}.actor.use_kl_loss=True",
    f"{ARR}.actor.kl_loss_type=low_var_kl",
    f"{ARR}.actor.ppo_mini_batch_size=64",
    f"{ARR}.actor.ppo_epochs=1",
]
CRITIC = [
    "algorithm.adv_estimator=gae",
    "critic.model.fsdp_config.optimizer_step_on_cpu=True",
    "critic.model.enable_gradient_checkpointing=True",
    "critic.use_dynamic_bsz=True",
    "critic.ppo_max_token_len_per_gpu=8192",
    "critic.ppo_mini_batch_size=64",
]


def workload(args) -> Workload:
    overrides = GRPO + RECIPE + (CRITIC if args.critic else [])
    if args.lora:  # only the adapters train: the optimizer state is small, it stays on the device
        overrides = [o for o in overrides if "optimizer_step_on_cpu" not in o]
        overrides += [f"{ARR}.model.lora_rank={args.lora}", f"{ARR}.model.lora_alpha={2 * args.lora}"]
    w = Workload(QWEN25_7B, "qwen2", 64, 8, 512, 512, overrides)
    if args.tiny:
        w = tiny_workload(w)
        w.overrides[:] = [o for o in w.overrides if "use_fused_kernels" not in o]
    return w


def predicted(overrides: list[str], model_dir: Path, device_gib: float) -> dict:
    """The memory model's peaks (GiB) for the configured run: each device phase and the host."""
    from transformers import AutoConfig

    from klppo.assembly.settings import fsdp_settings, tune_workload
    from klppo.config import load_config
    from klppo.tune.host import fit, host_ram_bytes

    cfg = load_config(overrides)
    device = "cuda" if cfg.trainer.device == "cuda" else "cpu"
    fsdp = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type=device, world_size=1)
    tw = tune_workload(cfg, fsdp, world_size=1, device_gib=device_gib)
    phases, host = fit(tw, AutoConfig.from_pretrained(model_dir), host_bytes=host_ram_bytes())
    return {
        **{f"predicted_gib/{k}": v / 2**30 for k, v in phases.items()},
        "predicted_gib/host": host / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--critic", action="store_true", help="PPO with a critic (GAE) instead of GRPO")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, 4 prompts × 2 (CPU smoke test)")
    p.add_argument("--rollout", default="klppo")
    p.add_argument("--set", action="append", default=[], help="further config overrides")
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", type=Path, help="a directory for the random model (kept between runs)")
    args = p.parse_args()
    args.grad_ckpt, args.count_syncs, args.count_ops = True, False, False
    args.profile, args.profile_rows = None, 0
    import torch

    w = workload(args)
    root = Path(tempfile.mkdtemp(prefix="seven_b_"))
    keep = args.keep or root
    model_dir = keep / f"{w.arch}-random"
    if not (model_dir / "config.json").exists():
        dtype = torch.float32 if args.tiny else torch.bfloat16
        model_dir = make_model_dir(keep, w.shape, w.arch, dtype)
    data = make_prompts(root, model_dir, prompt_len=w.prompt_len, rows=w.prompts * 4)
    run_dir = root / "run"
    overrides = base_overrides(w, model_dir, data, run_dir, args.rollout, args) + args.set
    cuda = args.device == "cuda"
    device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 80.0
    prediction = predicted(overrides, model_dir, device_gib)
    summary = run_trainer(overrides, run_dir, args)
    for i, seconds in enumerate(summary["steps_s"]):
        print(f"step {i + 1}: {seconds:.2f} s")
    phases = {k: v for k, v in sorted(summary.items()) if k.startswith("timing_s/")}
    tokens = w.prompts * w.n * (w.prompt_len + w.response_len)
    result = {
        "workload": "ppo_critic" if args.critic else "grpo_k3",
        "lora": args.lora,
        "tiny": args.tiny,
        "steps": args.steps,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / summary["timing_s/step"],
        "perf/throughput": summary.get("perf/throughput"),
        "mfu/actor": summary.get("perf/mfu/actor"),
        "mfu/critic": summary.get("perf/mfu/critic"),
        **phases,
        **prediction,
        "measured_gib/device": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "measured_gib/host_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
