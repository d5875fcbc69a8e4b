"""Seven billion parameters on one GPU (issue 53): the fixed workload, built through klppo's trainer.

Qwen2.5-7B shape with random weights, 64 prompts × 8 responses of 512 prompt + 512 response tokens
(responses forced to length with ``rollout.ignore_eos``), one mini-batch of 64 prompts per step (on-policy,
one update), GRPO with a k3 KL loss (``low_var_kl``; actor + reference); ``--critic``: GAE with a critic
(PPO: actor, reference, critic) on a Qwen2.5-1.5B-shaped value model with the actor's vocabulary (a second
random model dir, ``critic.model.path``), trained in full with its optimizer on the GPU and gradient
checkpointing — what the memory model says fits one H200 beside the recipe's actor
(``examples/qwen7b_ppo_one_gpu.yaml``); ``--lora 64``: LoRA rank 64 (the reference is the actor with adapters
off).
The run's settings are the recipe's (``examples/qwen7b_grpo_one_gpu.yaml``): the optimizer step on the CPU
(``fsdp_config.optimizer_step_on_cpu``), gradient checkpointing, the reference offloaded between its passes;
``--set key=value`` changes any of them.

Prints per step the phase times, and at the end one JSON line: the median over the steps after the first of
each phase time, tokens/s (verl's ``perf/throughput``: (prompt + response tokens) / step time, per GPU),
the update's MFU (``perf/mfu/actor``), and the memory model's predicted peaks beside the measured ones — the
device's per phase (``predicted_gib/rollout|log_prob|update``, the start-of-run forecast of
``klppo.assembly.memory_check``; ``measured_gib/<phase>``: ``torch.cuda.max_memory_allocated`` over the
trainer phases of that model phase, ``measured_gib/phase/<trainer phase>`` each, ``measured_gib/device`` the
largest)
and the host's (``predicted_gib/host``, ``klppo.tune.host``; ``measured_gib/host_rss``, the peak RSS) — and
one checkpoint's predicted size (``predicted_gib/checkpoint``, ``klppo.tune.disk``). ``--save DIR``: the run
in ``DIR/run`` writes a checkpoint at its last step through the trainer's checkpoint code
(``checkpoint_gib/written``, ``timing_s/save_checkpoint``; refused first when the start-up check predicts it
does not fit the disk), then resumes from it for one more step (``resume/load_s``, ``resume/step_s``).

    PYTHONPATH=$PWD python3 bench/seven_b.py --steps 4 --out $OUT/grpo.json          # (a) GRPO
    PYTHONPATH=$PWD python3 bench/seven_b.py --steps 4 --critic --out $OUT/ppo.json  # (b) PPO with a critic
    PYTHONPATH=$PWD python3 bench/seven_b.py --steps 4 --lora 64 --save /tmp/lora --out $OUT/lora.json
    PYTHONPATH=$PWD python3 bench/seven_b.py --device cpu --tiny --steps 2           # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
QWEN25_15B = config_kwargs("Qwen2.5-1.5B")
CRITIC = [  # examples/qwen7b_ppo_one_gpu.yaml: the critic's model path is the bench's second model dir
    "algorithm.adv_estimator=gae",
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


def model_dir_dtype(tiny: bool):
    import torch

    return torch.float32 if tiny else torch.bfloat16


def critic_model_dir(root: Path, w: Workload, *, tiny: bool) -> Path:
    """The critic's random model: Qwen2.5-1.5B's shape (``tiny``: the actor's tiny shape) with the actor's
    vocabulary, in ``root/critic`` (kept between runs with ``--keep``)."""
    path = root / "critic" / f"{w.arch}-random"
    if (path / "config.json").exists():
        return path
    shape = {**(w.shape if tiny else QWEN25_15B), "vocab_size": w.shape["vocab_size"]}
    return make_model_dir(root / "critic", shape, w.arch, model_dir_dtype(tiny))


def predicted(overrides: list[str], model_dir: Path, device_gib: float) -> dict:
    """The memory model's peaks (GiB) for the configured run — each device phase and the host — and one
    checkpoint's predicted size (``klppo.tune.disk``)."""
    from klppo.assembly.memory_check import forecast
    from klppo.assembly.startup_checks import disk_roles
    from klppo.config import load_config
    from klppo.tune import disk
    from klppo.tune.host import host_ram_bytes

    cfg = load_config(overrides)
    found = forecast(cfg, str(model_dir), world_size=1, device_gib=device_gib, host_bytes=host_ram_bytes(1))
    return {
        **{f"predicted_gib/{k}": v / 2**30 for k, v in found.device_bytes.items()},
        "predicted_gib/host": found.host.total / 2**30,
        "predicted_gib/checkpoint": disk.checkpoint_size(disk_roles(cfg, str(model_dir))).total / 2**30,
    }


MODEL_PHASES = {
    "rollout": ("gen",),
    "log_prob": ("old_log_prob", "ref"),
    "update": ("update_actor",),
    "values": ("values",),
    "update_critic": ("update_critic",),
}
"""The memory model's phases (``klppo.tune.memory.predict``) and the trainer's phases they are the peak of."""


@contextlib.contextmanager
def phase_peaks(on: bool):
    """On CUDA (``on``): each trainer phase's peak allocated GiB over the run (phases nested in it included),
    read by replacing the trainer's phase timer for the block; yields the dict it fills. The allocator's peak
    is reset at every phase edge, so the trainer's own ``perf/max_memory_allocated_gb`` is not the step's
    inside the block."""
    import torch

    from klppo.trainer import ppo_trainer
    from klppo.trainer.timer import PhaseTimer

    peaks: dict[str, float] = {}
    if not on:
        yield peaks
        return
    open_phases: list[str] = []

    def note() -> None:
        gib = torch.cuda.max_memory_allocated() / 2**30
        for name in open_phases:
            peaks[name] = max(peaks.get(name, 0.0), gib)
        torch.cuda.reset_peak_memory_stats()

    class PeakTimer(PhaseTimer):
        @contextlib.contextmanager
        def phase(self, name: str):
            note()
            open_phases.append(name)
            try:
                with super().phase(name):
                    yield
            finally:
                note()
                open_phases.pop()

    ppo_trainer.PhaseTimer = PeakTimer
    try:
        yield peaks
    finally:
        ppo_trainer.PhaseTimer = PhaseTimer


def measured_phases(peaks: dict[str, float]) -> dict:
    """The measured peaks beside the predicted ones: per model phase (its trainer phases' largest), and per
    trainer phase."""
    out = {f"measured_gib/phase/{k}": v for k, v in sorted(peaks.items())}
    for model_phase, names in MODEL_PHASES.items():
        found = [peaks[n] for n in names if n in peaks]
        if found:
            out[f"measured_gib/{model_phase}"] = max(found)
    return out


def save_and_resume(overrides: list[str], run_dir: Path, args, summary: dict) -> dict:
    """The checkpoint the last step wrote (``--save``): its bytes and write time; then the run resumed from it
    for one more step: the load's time and that step's."""
    from bench.ppo_step import run_trainer

    path = max(run_dir.glob("global_step_*"), key=lambda p: int(p.name.rpartition("_")[2]))
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    gc.collect()  # the first run's model and host state, before the resumed run builds its own
    resumed = run_trainer(overrides + [f"trainer.total_training_steps={args.steps + 1}"], run_dir, args)
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    return {
        "checkpoint": str(path),
        "checkpoint_gib/written": written / 2**30,
        "timing_s/save_checkpoint": summary["save_s"][-1],
        "resume/load_s": resumed.get("resume_load_s"),
        "resume/step": last["step"],
        "resume/step_s": last["timing_s/step"],
    }


def check_disk(overrides: list[str], model_dir: Path) -> None:
    """Exit 2 with the start-up check's sentence when one checkpoint is predicted not to fit the disk."""
    from klppo.assembly.startup_checks import check_run_dir, disk_roles
    from klppo.config import ConfigError, load_config

    cfg = load_config(overrides)
    try:
        print(check_run_dir(cfg, disk_roles(cfg, str(model_dir))))
    except ConfigError as exc:
        sys.exit(f"--save: {exc}")


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
    p.add_argument(
        "--save",
        type=Path,
        help="the run in DIR/run: its last step writes a checkpoint (timed), one more step resumes from it",
    )
    args = p.parse_args()
    args.grad_ckpt, args.count_syncs, args.count_ops = True, False, False
    args.profile, args.profile_rows = None, 0
    import torch

    w = workload(args)
    root = Path(tempfile.mkdtemp(prefix="seven_b_"))
    keep = args.keep or root
    model_dir = keep / f"{w.arch}-random"
    if not (model_dir / "config.json").exists():
        model_dir = make_model_dir(keep, w.shape, w.arch, model_dir_dtype(args.tiny))
    data = make_prompts(root, model_dir, prompt_len=w.prompt_len, rows=w.prompts * 4)
    run_dir = args.save / "run" if args.save else root / "run"
    overrides = base_overrides(w, model_dir, data, run_dir, args.rollout, args)
    if args.critic:
        overrides.append(f"critic.model.path={critic_model_dir(keep, w, tiny=args.tiny)}")
    overrides += args.set
    if args.save:
        overrides.append(f"trainer.save_freq={args.steps}")
        check_disk(overrides, model_dir)
    cuda = args.device == "cuda"
    device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 80.0
    prediction = predicted(overrides, model_dir, device_gib)
    with phase_peaks(cuda) as peaks:
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
        "measured_gib/device": max(peaks.values()) if peaks else None,
        **measured_phases(peaks),
        "measured_gib/host_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if args.save:
        result.update(save_and_resume(overrides, run_dir, args, summary))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
