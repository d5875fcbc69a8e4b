"""PPO-step timing breakdown (issues 4, 6, 18), several code variants measured in one invocation.

Workloads (random weights, responses forced to full length with ``rollout.ignore_eos``):

- ``trl``: Qwen2.5-0.5B shape, 16 prompts × 4 = 64 samples of 256 + 256 tokens, GAE with a critic, KL in
  the reward and a k3 KL loss (policy, reference and critic, like TRL's PPO), one epoch in 4 mini-batches,
  micro-batches of 16 samples (32 for the no-grad passes), packed.
- ``grpo135m``: SmolLM2-135M config, 32 prompts × 8 = 256 samples of 64 + 96 tokens, GRPO with a k3 KL
  loss, one mini-batch (on-policy), token-budget micro-batches of 16,384 tokens, packed.
- ``update15b``: no trainer: the actor role alone on a Qwen2.5-1.5B shape, one packed micro-batch of
  16 × (512 + 512) = 16,384 tokens per optimizer step (``--grad-ckpt`` for gradient checkpointing);
  reports the update time, ``perf/mfu/actor`` as the trainer computes it and the peak memory.

Variants (``--variants``): ``before`` (every candidate off) or ``after`` (all on, klppo's defaults), then
``+name`` / ``-name`` to switch one candidate on or off — each a configuration key a user also has:
``skip`` (``actor.skip_old_log_prob_on_policy``: the on-policy skip of the old-log-prob pass), ``fused_head``
(``model.use_fused_kernels``: chunked log-prob/entropy from the LM head), ``compiled_stats``
(``actor.use_torch_compile``, the reference following: the head's softmax statistics compiled on CUDA),
``fused_adamw`` (fused AdamW on CUDA; off: ``override_optimizer_config={fused: false}``), ``compile``
(``actor_rollout_ref.model.compile_packed_layers``: the actor's and the reference's decoder layers compiled
over the packed micro-batches; compilation falls in the first, unmeasured step), ``one_unit``
(``wrap_policy.min_num_params`` auto, the default: one FSDP unit per model when one process trains; off:
0, one unit per decoder layer), ``plain`` (``fsdp_config.plain_single_gpu`` auto; off: FSDP2 on one
process); and settings that are not candidates: ``+critic_compile`` (the critic packed,
``critic.model.use_remove_padding``, and compiled likewise; the ``trl`` critic runs padded otherwise),
``+no_reshard`` (``reshard_after_forward=False``), ``+ckpt`` (gradient checkpointing), ``+async_reward``
(background scoring: ``reward_model.launch_reward_fn_async``), ``+graphs`` (the actor's and the critic's
update micro-batches and the no-grad forward micro-batches — old log-probs, values, the reference's
log-probs — replayed as CUDA graphs, ``fsdp_config.cuda_graph_update`` of the actor, the critic and the
reference; the critic needs ``+critic_compile`` for packed rows). Code that is not a setting is compared
across commits: ``bench/ab.py REV_A REV_B -- python3 bench/ppo_step.py --variants after``.
E.g. ``--variants before after after-fused_head``. Each variant builds its run from scratch in this
process; the trainer workloads report the median of the steps after the first (which includes warm-up:
allocator growth, CUDA-graph capture, compilation).

    PYTHONPATH=$PWD python3 bench/ppo_step.py --workload trl --variants before after --out $OUT/trl.json
    PYTHONPATH=$PWD python3 bench/ppo_step.py --device cpu --tiny --workload grpo135m --steps 2   # smoke test
    # bench/learning.py's batch (256 prompts × 8) with a setting A/B'd through --set, one invocation per
    value: PYTHONPATH=$PWD python3 bench/ppo_step.py --workload grpo135m --prompts 256 --steps 4 --variants
    after \
        --set actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=262144 --out $OUT/ref262144.json

``--count-ops`` adds ``ops/<phase>``: aten operators dispatched per step in each trainer phase (host work of a
launch-bound step; not a timing run). ``--count-syncs`` (CUDA) adds ``cuda_syncs/passes`` and
``cuda_syncs/other``: host-device synchronisations
per step in the training passes and elsewhere (``torch.cuda.set_sync_debug_mode``; not a timing run).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from klppo.tune.shapes import config_kwargs

# the measured shapes, from klppo's table (klppo/tune/shapes.py): the same configs `klppo tune` models
QWEN25_05B = config_kwargs("Qwen2.5-0.5B")
QWEN25_15B = config_kwargs("Qwen2.5-1.5B")
SMOLLM2_135M = config_kwargs("SmolLM2-135M")
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=384,
)

ARR = "actor_rollout_ref"
FSDP_ROLES = (f"{ARR}.actor", f"{ARR}.ref", "critic.model")
CANDIDATES = {  # name: (overrides when on, overrides when off)
    "skip": (
        [f"{ARR}.actor.skip_old_log_prob_on_policy=True"],
        [f"{ARR}.actor.skip_old_log_prob_on_policy=False"],
    ),
    "fused_head": ([f"{ARR}.model.use_fused_kernels=True"], [f"{ARR}.model.use_fused_kernels=False"]),
    # the default: the LM head's log-prob/entropy statistics compiled on CUDA (actor.use_torch_compile)
    "compiled_stats": ([f"{ARR}.actor.use_torch_compile=True"], [f"{ARR}.actor.use_torch_compile=False"]),
    "compile": ([f"{ARR}.model.compile_packed_layers=True"], [f"{ARR}.model.compile_packed_layers=False"]),
    "one_unit": (  # min_num_params auto, the default: one FSDP unit per model on one process
        [],
        [f"{r}.fsdp_config.wrap_policy.min_num_params=0" for r in FSDP_ROLES],
    ),
    "fused_adamw": (
        [],  # the default on CUDA (klppo.roles.optim.build_optimizer)
        [f"{role}.optim.override_optimizer_config={{fused: false}}" for role in (f"{ARR}.actor", "critic")],
    ),
    # plain_single_gpu auto, the default: no FSDP2 on one process, fp32 masters (parallel/plain.py)
    "plain": (
        [],
        [f"{role}.fsdp_config.plain_single_gpu=false" for role in (f"{ARR}.actor", "critic.model")],
    ),
}
SETTINGS = {
    "critic_compile": ["critic.model.use_remove_padding=True", "critic.model.compile_packed_layers=True"],
    "no_reshard": [f"{r}.fsdp_config.reshard_after_forward=False" for r in FSDP_ROLES],
    "ckpt": [
        f"{ARR}.model.enable_gradient_checkpointing=True",
        "critic.model.enable_gradient_checkpointing=True",
    ],
    # the update and no-grad forward micro-batches replayed as CUDA graphs (fsdp_config.cuda_graph_update; the
    # plain path, packed rows)
    "graphs": [f"{role}.fsdp_config.cuda_graph_update=True" for role in FSDP_ROLES],
    # background scoring (reward_model.launch_reward_fn_async): decoding and the reward function in spawned
    # workers while the log-prob, reference and value passes run
    "async_reward": ["reward_model.launch_reward_fn_async=True"],
}


def variant_overrides(name: str) -> list[str]:
    """``before|after`` then ``+x`` / ``-x`` items (see the module docstring) → config overrides."""
    base, *items = re.split(r"(?=[+-])", name)
    if base not in ("before", "after"):
        raise ValueError(f"--variants {name!r}: start with before or after, then +name/-name")
    on = {c: base == "after" for c in CANDIDATES}
    extra: list[str] = []
    for item in items:
        sign, key = item[0], item[1:]
        if key in CANDIDATES:
            on[key] = sign == "+"
        elif key in SETTINGS and sign == "+":
            extra += SETTINGS[key]
        else:
            raise ValueError(
                f"--variants {name!r}: unknown {item!r}; candidates {sorted(CANDIDATES)}, settings (+ only) "
                f"{sorted(SETTINGS)}"
            )
    return [o for c, flag in on.items() for o in CANDIDATES[c][0 if flag else 1]] + extra


@dataclass(frozen=True)
class Workload:
    shape: dict
    arch: str
    prompts: int
    n: int
    prompt_len: int
    response_len: int
    overrides: list[str] = field(default_factory=list)


WORKLOADS = {
    "trl": Workload(
        QWEN25_05B,
        "qwen2",
        16,
        4,
        256,
        256,
        [
            f"{ARR}.actor.ppo_mini_batch_size=4",
            f"{ARR}.actor.ppo_micro_batch_size_per_gpu=16",
            f"{ARR}.rollout.log_prob_micro_batch_size_per_gpu=32",
            f"{ARR}.ref.log_prob_micro_batch_size_per_gpu=32",
            "critic.ppo_micro_batch_size_per_gpu=16",
            "critic.forward_micro_batch_size_per_gpu=32",
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=True",
            f"{ARR}.actor.use_kl_loss=True",
        ],
    ),
    "grpo135m": Workload(
        SMOLLM2_135M,
        "llama",
        32,
        8,
        64,
        96,
        [
            f"{ARR}.actor.ppo_mini_batch_size=32",
            f"{ARR}.actor.use_dynamic_bsz=True",
            f"{ARR}.actor.ppo_max_token_len_per_gpu=16384",
            f"{ARR}.rollout.log_prob_use_dynamic_bsz=True",
            f"{ARR}.rollout.log_prob_max_token_len_per_gpu=16384",
            "algorithm.adv_estimator=grpo",
            f"{ARR}.actor.use_kl_loss=True",
            f"{ARR}.actor.kl_loss_type=low_var_kl",
        ],
    ),
    "update15b": Workload(
        QWEN25_15B,
        "qwen2",
        16,
        1,
        512,
        512,
        [
            f"{ARR}.actor.ppo_mini_batch_size=16",
            f"{ARR}.actor.use_dynamic_bsz=True",
            f"{ARR}.actor.ppo_max_token_len_per_gpu=16384",
            f"{ARR}.rollout.log_prob_use_dynamic_bsz=True",
            f"{ARR}.rollout.log_prob_max_token_len_per_gpu=16384",
            "algorithm.adv_estimator=grpo",
        ],
    ),
}


def tiny_workload(w: Workload) -> Workload:
    """The same workload on a 2-layer model with 4 prompts × 2 of 16 + 8 tokens (CPU smoke test)."""

    def shrink(o: str) -> str:
        key, value = o.split("=", 1)
        if key.endswith("max_token_len_per_gpu"):
            return f"{key}=64"
        if key.endswith("ppo_mini_batch_size"):  # keeps the number of mini-batches
            return f"{key}={max(1, int(value) * 4 // w.prompts)}"
        if key.endswith("micro_batch_size_per_gpu"):
            return f"{key}=2"
        return o

    return Workload({**w.shape, **TINY}, w.arch, 4, 2, 16, 8, [shrink(o) for o in w.overrides])


def scaled_workload(w: Workload, prompts: int) -> Workload:
    """``--prompts N``: the workload with N prompts per step, its mini-batch sizes scaled alike (the same
    number of mini-batches; grpo135m at 256 is bench/learning.py's batch, 256 × 8 samples)."""

    def scale(o: str) -> str:
        key, value = o.split("=", 1)
        if key.endswith("ppo_mini_batch_size"):
            return f"{key}={max(1, int(value) * prompts // w.prompts)}"
        return o

    return Workload(
        w.shape, w.arch, prompts, w.n, w.prompt_len, w.response_len, [scale(o) for o in w.overrides]
    )


def make_model_dir(root: Path, shape: dict, arch: str, dtype) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from klppo.models.tiny import build_tiny_tokenizer

    path = root / f"{arch}-random"
    config = AutoConfig.for_model(arch, bos_token_id=1, eos_token_id=2, pad_token_id=2, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def make_prompts(root: Path, tokenizer_dir: Path, *, prompt_len: int, rows: int) -> Path:
    """GSM8K-schema rows whose chat-templated prompt is exactly ``prompt_len`` tokens."""
    from transformers import AutoTokenizer

    from klppo.data.gsm8k import make_row, write_rows

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def length(k: int) -> int:
        msgs = [{"role": "user", "content": "7 " * k}]
        return len(
            tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))["input_ids"]
        )

    k = next(k for k in range(prompt_len) if length(k) >= prompt_len)
    rows_ = [make_row(question="7 " * k, answer="#### 7", split="train", index=i) for i in range(rows)]
    rows_ = [dict(r, prompt=[{"role": "user", "content": "7 " * k}]) for r in rows_]
    out = root / "prompts.parquet"
    write_rows(rows_, out)
    return out


def base_overrides(w: Workload, model_dir: Path, data: Path, run_dir: Path, rollout: str, args) -> list[str]:
    return [
        f"{ARR}.model.path={model_dir}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={w.prompts}",
        f"data.max_prompt_length={w.prompt_len}",
        f"data.max_response_length={w.response_len}",
        "data.filter_overlong_prompts=False",
        "data.truncation=left",
        f"{ARR}.rollout.n={w.n}",
        f"{ARR}.rollout.name={rollout}",
        f"{ARR}.rollout.ignore_eos=True",
        f"{ARR}.rollout.gpu_memory_utilization=0.6",
        f"{ARR}.model.enable_gradient_checkpointing={args.grad_ckpt}",
        f"critic.model.enable_gradient_checkpointing={args.grad_ckpt}",
        f"trainer.device={args.device}",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={args.steps}",
        f"trainer.default_local_dir={run_dir}",
        *w.overrides,
    ]


def run_trainer(overrides: list[str], run_dir: Path, args) -> dict:
    """``--steps`` trainer steps; the median of each metric over the steps after the first, with ``save_s``
    (each checkpoint's write, with ``trainer.save_freq``) and ``resume_load_s`` (a resumed run's load)."""
    import torch

    from klppo.assembly.setup import build_run
    from klppo.config import load_config
    from klppo.parallel import dist
    from klppo.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(overrides)
    info = dist.init_distributed(args.device, 600.0)
    prof = Profile(args, run_dir.name, skip=args.steps - 1)
    syncs = SyncCount(args.count_syncs and args.device == "cuda")
    ops = OpCount(args.count_ops)
    host = HostProbe()
    saves: list[
        float
    ] = []  # seconds of each checkpoint written (trainer.save_freq), and of the resume's load
    loads: list[float] = []

    class Trainer(PPOTrainer):
        def save(self):
            _device_sync()
            start = time.perf_counter()
            super().save()
            saves.append(time.perf_counter() - start)

        def _maybe_resume(self):
            start = time.perf_counter()
            super()._maybe_resume()
            if self.run.resume_path is not None:
                loads.append(time.perf_counter() - start)

        def train_step(self, prompts, step):
            _device_sync()
            start = time.perf_counter()
            with ops:
                out = super().train_step(prompts, step)
            _device_sync()
            out["bench/wall_step_s"] = (
                time.perf_counter() - start
            )  # the host's clock, whatever the timer does
            prof.step()
            syncs.step()
            ops.step()
            host.step()
            return out

    try:
        start = time.perf_counter()
        built = build_run(cfg, device=info.device, argv=overrides)
        setup_s = time.perf_counter() - start  # with rollout=klppo the decode functions compile meanwhile
        with prof, syncs, host:
            Trainer(built).fit()
    finally:
        dist.destroy()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    del built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    later = rows[1:] or rows
    keys = set.intersection(*(set(r) for r in later))
    summary = {
        k: statistics.median(r[k] for r in later) for k in keys if isinstance(later[0][k], float | int)
    }
    summary.update(syncs.summary())
    summary.update(ops.summary())
    summary.update(host.summary())
    summary["steps_s"] = [r["timing_s/step"] for r in rows]
    if saves:
        summary["save_s"] = saves
    if loads:
        summary["resume_load_s"] = loads[0]
    summary["setup_s"] = setup_s
    summary["first_step_s"] = rows[0]["timing_s/step"]
    if "timing_s/gen" in summary:
        summary["train_s (step - gen)"] = summary["timing_s/step"] - summary["timing_s/gen"]
        summary["wall train_s (wall step - gen)"] = summary["bench/wall_step_s"] - summary["timing_s/gen"]
    return summary


def _device_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HostProbe:
    """Host time that no trainer phase names: Python's garbage collector per step (``host/gc_s``, the time
    inside collections through ``gc.callbacks``; ``host/gc_full``, full collections), the objects it tracks
    at the end (``host/gc_objects``: compilation leaves many), and a fixed pure-Python loop timed when the run
    starts (``host/python_loop_s``: tells a slow host from slow code between calls and machines)."""

    def __init__(self) -> None:
        self.per_step: list[tuple[float, int]] = []
        self.gc_s, self.full, self._t0, self.loop_s, self.objects = 0.0, 0, 0.0, 0.0, 0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._t0
            self.full += info.get("generation") == 2

    def __enter__(self) -> HostProbe:
        start = time.perf_counter()
        total = 0
        for i in range(2_000_000):
            total += i % 7
        self.loop_s = time.perf_counter() - start
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)
        self.objects = len(gc.get_objects())

    def step(self) -> None:
        self.per_step.append((self.gc_s, self.full))
        self.gc_s, self.full = 0.0, 0

    def summary(self) -> dict[str, float]:
        later = self.per_step[1:] or self.per_step
        out = {"host/python_loop_s": self.loop_s, "host/gc_objects": float(self.objects)}
        if later:
            out["host/gc_s"] = statistics.median(s for s, _ in later)
            out["host/gc_full"] = statistics.median(f for _, f in later)
        return out


class SyncCount:
    """With ``--count-syncs`` (CUDA): every host-device synchronisation counted through
    ``torch.cuda.set_sync_debug_mode("warn")``, per step, split into the training passes (a frame in
    ``klppo/roles`` or ``klppo/batching``: log-probs, reference, values, updates) and the rest (generation,
    reward, advantages, logging). The warnings cost time: timings of such a run are not comparable."""

    PASSES = ("klppo/roles/", "klppo/batching/")

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.counts, self.current = enabled, [], {"passes": 0, "other": 0}
        self._ctx = None

    def __enter__(self):
        if self.enabled:
            import warnings

            import torch

            self._ctx = warnings.catch_warnings()
            self._ctx.__enter__()
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if "synchronizing CUDA operation" not in str(message):
                    return shown(message, category, filename, lineno, file, line)
                frames = traceback.extract_stack()
                key = "passes" if any(p in f.filename for f in frames for p in self.PASSES) else "other"
                self.current[key] += 1

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            import torch

            torch.cuda.set_sync_debug_mode(0)
            self._ctx.__exit__(*exc)

    def step(self) -> None:
        self.counts.append(self.current)
        self.current = {"passes": 0, "other": 0}

    def summary(self) -> dict[str, float]:
        later = self.counts[1:] or self.counts
        if not self.enabled or not later:
            return {}
        return {f"cuda_syncs/{k}": statistics.median(c[k] for c in later) for k in ("passes", "other")}


class OpCount:
    """With ``--count-ops``: aten operators dispatched per step (``TorchDispatchMode``, below autograd, so
    backward operators count too), per innermost trainer phase (``klppo.parallel.dist.current_phase``).
    A launch-bound step issues one kernel per operator outside compiled graphs: the count is its host
    work. Counting slows the run: timings of such a run are not comparable."""

    def __init__(self, enabled: bool, top: int = 15) -> None:
        self.enabled, self.counts, self.top = enabled, [], top  # counts: {phase: operators} per step
        self.current: dict[tuple[str, str], int] = {}  # (phase, operator) → count, this step
        self.last_by_name: dict[tuple[str, str], int] = {}  # the same, the last finished step
        self._mode = None

    def __enter__(self):
        if self.enabled:
            from torch.utils._python_dispatch import TorchDispatchMode

            from klppo.parallel.dist import current_phase

            counts = self.current

            class Mode(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    name = (current_phase(), str(func.overloadpacket))
                    counts[name] = counts.get(name, 0) + 1
                    return func(*args, **(kwargs or {}))

            self._mode = Mode()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None

    def step(self) -> None:
        if self.enabled:
            per_phase: dict[str, int] = {}
            for (phase, _), n in self.current.items():
                per_phase[phase] = per_phase.get(phase, 0) + n
            self.counts.append(per_phase)
            self.last_by_name, self.current = self.current, {}

    def summary(self) -> dict[str, float | str]:
        """``ops/<phase>``: operators per step (median of the steps after the first); ``ops_top/<phase>``:
        the last step's most frequent operators of that phase, "name count, …" — where the host time goes."""
        later = self.counts[1:] or self.counts
        if not later:
            return {}
        keys = sorted(set().union(*later))
        out: dict[str, float | str] = {
            f"ops/{k}": statistics.median(c.get(k, 0) for c in later) for k in keys
        }
        for k in keys:
            ranked = sorted(
                ((n, c) for (p, n), c in self.last_by_name.items() if p == k), key=lambda x: -x[1]
            )
            out[f"ops_top/{k}"] = ", ".join(f"{n} {c}" for n, c in ranked[: self.top])
        return out


class Profile:
    """With ``--profile DIR``: torch.profiler over one step (after ``skip`` calls of :meth:`step`); prints the
    top operators by device time and the device-busy share of the step, writes a gzipped Chrome trace to DIR
    (``bench/trace_phases.py`` reads it)."""

    def __init__(self, args, label: str, *, skip: int) -> None:
        self.args, self.label, self.prof = args, label, None
        if args.profile:
            from torch.profiler import ProfilerActivity, profile, schedule

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
            self.prof = profile(
                activities=activities,
                schedule=schedule(wait=max(0, skip), warmup=0, active=1),
                on_trace_ready=self._report,
            )
        self._start = 0.0

    def __enter__(self) -> Profile:
        if self.prof is not None:
            self.prof.__enter__()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.prof is not None:
            self.prof.__exit__(*exc)

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def _report(self, prof) -> None:
        out = Path(self.args.profile)
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(
            str(out / f"{self.args.workload}_{self.label}.json.gz")
        )  # gzip: 139 → ~15 MB, fits a device call's return
        events = prof.key_averages()
        device_s = kernel_seconds(events)
        wall_s = sum(e.cpu_time_total for e in events if e.key.startswith("ProfilerStep")) / 1e6
        print(
            f"\n== profile {self.args.workload}/{self.label}: device kernels {device_s:.3f} s in a "
            f"{wall_s:.3f} s step ({device_s / max(wall_s, 1e-9):.0%} busy)"
        )
        sort = "self_device_time_total" if self.args.device == "cuda" else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=self.args.profile_rows, max_name_column_width=60))


RANGES = ("ProfilerStep", "phase/")  # record_function ranges: on CUDA they carry the device time they span


def kernel_seconds(events) -> float:
    """Device time of the kernels and copies of a profile's ``key_averages()``: device-side events only (a
    CPU operator's self device time is its kernels' time, which the kernels' own events carry again), and no
    annotated range (the profiler step, ``phase/*``, ``FSDP::*``, ``Optimizer.step``: each spans kernels
    already counted, so counting them too would count every kernel twice). Summed, not unioned:
    concurrent streams can exceed the wall time; the union of kernel intervals per phase is
    ``bench/trace_phases.py``'s."""
    from torch.autograd import DeviceType

    return (
        sum(
            e.self_device_time_total
            for e in events
            if e.device_type != DeviceType.CPU
            and not getattr(e, "is_user_annotation", False)
            and not e.key.startswith(RANGES)
        )
        / 1e6
    )


def synthetic_batch(w: Workload, vocab: int, device):
    """``prompts`` × (prompt_len + response_len) real tokens, random ids and advantages."""
    import torch

    from klppo.batch import Batch

    g = torch.Generator().manual_seed(0)
    B, P, R = w.prompts * w.n, w.prompt_len, w.response_len
    return Batch(
        prompts=torch.randint(3, vocab, (B, P), generator=g),
        prompt_mask=torch.ones(B, P, dtype=torch.long),
        responses=torch.randint(3, vocab, (B, R), generator=g),
        response_mask=torch.ones(B, R),
        advantages=torch.randn(B, R, generator=g),
    ).to(device)


def run_update(w: Workload, overrides: list[str], model_dir: Path, name: str, args) -> dict:
    """The actor alone: one no-grad log-prob pass, then ``--steps`` updates after one warm-up (min time)."""
    import torch

    from klppo.assembly.roles_build import RoleInputs, build_actor
    from klppo.assembly.settings import fsdp_settings
    from klppo.config import derive_sizes, load_config
    from klppo.models.flops import device_peak_flops, model_flops_per_token
    from klppo.models.loading import load_tokenizer
    from klppo.parallel import dist
    from klppo.parallel.offload import OffloadSchedule

    cfg = load_config(overrides)
    info = dist.init_distributed(args.device, 600.0)
    device = info.device
    cuda = device.type == "cuda"
    # what earlier variants of this process left allocated (it would otherwise count in the later peaks)
    held_before = torch.cuda.memory_allocated(device) / 2**30 if cuda else 0.0

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    try:
        inputs = RoleInputs(
            cfg,
            derive_sizes(cfg, 1),
            str(model_dir),
            load_tokenizer(str(model_dir)),
            device,
            total_steps=100,
            offload=OffloadSchedule(device),
            hf_assets={},
        )
        actor = build_actor(
            inputs,
            fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type=device.type, world_size=1),
        )
        batch = synthetic_batch(w, actor.model.config.vocab_size, device)
        t0 = now()
        batch.old_log_probs = actor.compute_log_prob(batch)  # ratio 1: an ordinary PPO update
        log_prob_s = now() - t0
        times, peaks = [], []
        with Profile(args, name, skip=args.steps) as prof:  # the last update
            for _ in range(1 + args.steps):
                if cuda:
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = now()
                metrics = actor.update_policy(batch)
                times.append(now() - t0)
                peaks.append(torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0)
                prof.step()
        tokens = float(batch.attention_mask.sum())
        seq = w.prompt_len + w.response_len
        flops = model_flops_per_token(actor.model.config, seq_len=seq) * tokens
        peak = device_peak_flops(torch.cuda.get_device_name(device)) if cuda else None
        best = min(times[1:])
        out = {
            "timing_s/old_log_prob": log_prob_s,
            "timing_s/update_actor": best,
            "first_update_s": times[0],
            "tokens_per_s": tokens / best,
            "perf/max_memory_allocated_gb": max(peaks[1:]),
            "actor/grad_norm": metrics["actor/grad_norm"],
            "perf/allocated_before_gb": held_before,
        }
        if peak:
            out["perf/mfu/actor"] = flops / (best * peak)
        del actor, batch
    finally:
        dist.destroy()
    if cuda:
        torch.cuda.empty_cache()
    return out


ROWS = [
    "timing_s/gen",
    "rollout/graph_capture_s",
    "rollout/prefill_s",
    "timing_s/old_log_prob",
    "timing_s/ref",
    "timing_s/values",
    "timing_s/reward",
    "timing_s/adv",
    "timing_s/update_critic",
    "timing_s/update_actor",
    "timing_s/step",
    "train_s (step - gen)",
    "wall train_s (wall step - gen)",
    "bench/wall_step_s",
    "first_step_s",
    "first_update_s",
    "setup_s",
    "tokens_per_s",
    "perf/throughput",
    "perf/mfu/actor",
    "perf/max_memory_allocated_gb",
    "perf/allocated_before_gb",
    "rollout/log_prob_diff",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "cuda_syncs/passes",
    "cuda_syncs/other",
    "host/python_loop_s",
    "host/gc_s",
    "host/gc_full",
    "host/gc_objects",
]


def print_table(title: str, results: dict[str, dict]) -> None:
    names = list(results)
    print(f"\n{title}\n| metric | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for name in names:
        if "error" in results[name]:
            print(f"| {name} failed | {results[name]['error']} |")
    for key in ROWS:
        if any(key in r for r in results.values()):
            cells = [f"{results[n][key]:.4g}" if key in results[n] else "–" for n in names]
            print(f"| {key} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="trl")
    parser.add_argument("--variants", nargs="+", default=["before", "after"])
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides for every variant")
    parser.add_argument("--rollouts", nargs="+", default=["klppo"], help="klppo | hf (each × each variant)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--prompts", type=int, default=None, help="prompts per step (mini-batches scaled alike)"
    )
    parser.add_argument("--grad-ckpt", action="store_true")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default=None, help="DIR: profile the last step of each variant")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument(
        "--count-syncs", action="store_true", help="count host-device syncs per step (CUDA; slows the run)"
    )
    parser.add_argument(
        "--count-ops", action="store_true", help="count aten operators per step and phase (slows the run)"
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer model of the workload's arch (smoke test)"
    )
    args = parser.parse_args()
    import torch

    w = WORKLOADS[args.workload]
    if args.tiny:
        w = tiny_workload(w)
    if args.prompts:
        w = scaled_workload(w, args.prompts)
    variants = {name: variant_overrides(name) for name in args.variants}  # bad names fail before any work
    root = Path(tempfile.mkdtemp(prefix="klppo_bench_"))
    dtype = torch.bfloat16 if args.workload == "update15b" and not args.tiny else torch.float32
    model_dir = make_model_dir(root, w.shape, w.arch, dtype)
    data = make_prompts(root, model_dir, prompt_len=w.prompt_len, rows=w.prompts * args.steps)
    results: dict[str, dict] = {}
    runs = [(v, r) for r in args.rollouts for v in variants]
    for variant, rollout in runs:
        extra = variants[variant]
        name = variant if len(args.rollouts) == 1 else f"{variant} ({rollout})"
        run_dir = root / f"run_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"
        overrides = base_overrides(w, model_dir, data, run_dir, rollout, args) + extra + list(args.set)
        try:
            if args.workload == "update15b":
                results[name] = run_update(w, overrides, model_dir, name, args)
            else:
                results[name] = run_trainer(overrides, run_dir, args)
        except Exception as e:  # record and go on: one failing variant must not lose the others
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        finally:  # the compiled code caches hold the finished variant's tensors: let them go, then collect
            torch._dynamo.reset()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        print(
            f"== {args.workload} / {name}: "
            + json.dumps({k: round(v, 4) for k, v in results[name].items() if k in ROWS}),
            flush=True,
        )
        for key, top in results[name].items():
            if key.startswith("ops_top/"):
                print(f"   {key}: {top}")
        if args.out:
            Path(args.out).write_text(
                json.dumps({"args": vars(args), "variants": variants, "results": results}, indent=1)
            )
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print_table(
        f"{args.workload}: {device}, torch {torch.__version__}, gradient checkpointing "
        f"{'on' if args.grad_ckpt else 'off'}, rollout {' / '.join(args.rollouts)}",
        results,
    )


if __name__ == "__main__":
    main()
