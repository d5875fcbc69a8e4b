"""Multi-GPU runs: NCCL smoke, FSDP2 threshold/prefetch sweep, PPO scaling, offload.

Run once per GPU count K (from the repository root, ``PYTHONPATH=$PWD``; the trainer needs omegaconf on
the device: install it there or carry it as a wheel)::

    python bench/multi_gpu.py --run all --gpus K --out $OUT/k$K      # K = 1, 2, 4, 8 (smoke skipped at 1)
    python bench/multi_gpu.py --summarize DIR                        # markdown tables of the runs

Before/after of a setting, K = 1 and 2 in one call (each variant's efficiency against its own K = 1)::

    python bench/multi_gpu.py --run scaling --gpus 2 --scaling-ks 1,2 --out $OUT/ab \
        --variant 'per_micro:actor_rollout_ref.actor.fsdp_config.grad_sync_per_mini_batch=false
        critic.model.fsdp_config.grad_sync_per_mini_batch=false' \
        --variant auto

- ``smoke``: the trainer with K processes and with 1 process, first 3 steps of a Qwen2.5-0.5B-shaped
  random model, greedy rollouts, one mini-batch per step (so every sample's math is independent of the
  rank layout): losses compared per step. Tolerance: fp32 (CPU) rel 1e-4 (summation order only, as
  tests/trainer/test_distributed.py); bf16 (GPU) rel 2e-2: bf16 keeps 8 mantissa bits (rounding 2^-8 ≈
  4e-3) and K ranks change the micro-batch shapes (other GEMM tilings) and the gradient reduction order,
  so per-token log-probs differ at ~4e-3 and that drifts through 3 updates; 2e-2 leaves ~5x margin while a
  real layout bug (gradients summed instead of averaged, a rank seeing the wrong rows) is off by O(1).
  Metrics that are zero by construction (whitened advantages, on-policy pg_loss, kl_loss at step 1) get
  an absolute tolerance instead. Caveat: greedy decoding on a random model has near-ties; a bf16 flip
  changes a response and then its losses; ``--smoke-dtype fp32`` removes that (tolerance 1e-3).
- ``sweep``: K ranks (relaunched under torchrun), :func:`klppo.tune.measure.measure_point` per point:
  min_num_params {0, 1e7, 1e8, whole} x forward_prefetch x reshard_after_forward for the 1.5B and 7B
  shapes; peak memory per GPU (max over ranks), actor-update time, exposed communication (profiler:
  NCCL kernel time not covered by compute) as a share of the update. Also the memory model's prediction.
- ``scaling``: the trainer end to end, train_batch_size 32·K prompts, n 4, prompt 512, response 512
  (ignore_eos), GAE + critic + KL; ``perf/throughput`` is tokens/s per GPU, so the efficiency
  ``throughput(K) / (K · throughput(1))`` of total throughputs is the per-GPU ratio (``--summarize``).
- ``offload``: the trainer on the 7B shape (GRPO + KL loss: actor + reference, no critic), actor
  param_offload + optimizer_offload and reference param_offload on vs off: step time and memory per GPU.

The NCCL environment (NCCL_NVLS_ENABLE=0, ...) is left as the machine sets it and recorded in each JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/multi_gpu.py` puts bench/ on the path, not the repository
    sys.path.insert(0, str(ROOT))

RUNS = ("smoke", "sweep", "scaling", "offload")
THRESHOLDS = [0, 10**7, 10**8, 10**12]  # 10**12 = klppo.tune.units.WHOLE_MODEL: the root is the only unit
TINY_THRESHOLDS = [0, 20_000, 50_000, 10**12]  # the tiny shape has ~1e5 parameters
# metric -> absolute tolerance (used besides the relative one; large for metrics zero by construction)
SMOKE_METRICS = {
    "actor/pg_loss": 1e-3,
    "actor/kl_loss": 1e-4,
    "actor/ppo_kl": 1e-4,
    "actor/entropy": 0.0,
    "actor/grad_norm": 0.0,
    "critic/vf_loss": 0.0,
    "critic/grad_norm": 0.0,
    "critic/values/mean": 1e-3,
    "critic/returns/mean": 1e-4,
    "critic/advantages/mean": 1e-3,
    "response_length/mean": 0.0,
}

# the smoke test's reward: a deterministic hash of response + expected answer, spread over [0, 1), so that
# advantages, value targets and gradients are non-zero from step 1 (a random model never solves a question,
# and a tiny one may answer every prompt alike)
SMOKE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    text = solution_str + "|" + str(ground_truth)
    return (sum(ord(c) * (i + 1) for i, c in enumerate(text)) % 101) / 100
"""


def tiny_shape():
    from klppo.tune.shapes import ModelShape

    return ModelShape("tiny", "qwen2", 64, 2, 4, 2, 128, 384, True)  # vocab = the tiny tokenizer's


def model_config(name: str, tiny: bool):
    from klppo.tune.shapes import config_from_shape

    return config_from_shape(tiny_shape() if tiny else name)


def machine_meta(args, run: str) -> dict:
    import torch
    import transformers

    cuda = torch.cuda.is_available() and args.device == "cuda"
    return {
        "run": run,
        "gpus": args.gpus,
        "device": args.device,
        "tiny": args.tiny,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "argv": sys.argv,
        "gpu_name": torch.cuda.get_device_name(0) if cuda else None,
        "visible_gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL", "CUDA_VISIBLE"))},
    }


def write_json(out: Path, name: str, data: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


# ---------------------------------------------------------------- trainer runs (smoke, scaling, offload)


def make_model_dir(root: Path, name: str, *, tiny: bool, device: str) -> Path:
    """A random model of shape ``name`` saved as an HF directory with the tiny tokenizer (eos=pad=2);
    initialised on the GPU when there is one (a 7B shape in seconds), stored in bf16 on GPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from klppo.models.tiny import build_tiny_tokenizer

    path = root / f"model-{'tiny' if tiny else name}"
    if path.exists():
        return path
    config = model_config(name, tiny)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    on_gpu = device == "cuda" and torch.cuda.is_available()
    torch.manual_seed(0)
    with torch.device("cuda" if on_gpu else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    del model
    if on_gpu:
        torch.cuda.empty_cache()
    return path


def trainer_argv(
    model_dir: Path,
    data: tuple,
    run_dir: Path,
    args,
    *,
    k: int,
    batch: int,
    n: int,
    prompt_len: int,
    response_len: int,
    steps: int,
    extra: list[str],
) -> list[str]:
    """Overrides of one trainer run: one PPO epoch, ``batch`` prompts x ``n``, responses forced to
    ``response_len`` tokens (random weights never emit EOS), jsonl metrics in ``run_dir``."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={data[0]}",
        f"data.val_files={data[1]}",
        f"data.train_batch_size={batch}",
        f"data.max_prompt_length={prompt_len}",
        f"data.max_response_length={response_len}",
        "data.filter_overlong_prompts=False",
        "data.truncation=left",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.name={args.rollout}",
        "actor_rollout_ref.rollout.ignore_eos=True",
        "reward_model.reward_kwargs={method: flexible}",
        f"trainer.device={args.device}",
        f"trainer.n_gpus_per_node={k}",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


def run_trainer(argv: list[str], run_dir: Path) -> list[dict]:
    """``python -m klppo.trainer.main_ppo argv`` in a fresh process (it relaunches itself under torchrun
    for K > 1); returns the metrics rows. Raises with the log's tail when it fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "trainer.log"
    with log.open("w") as f:
        code = subprocess.call(
            [sys.executable, "-m", "klppo.trainer.main_ppo", *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )
    metrics = run_dir / "metrics.jsonl"
    rows = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if metrics.exists()
        else []
    )
    if code != 0:
        finished = "done:" in log.read_text() and rows
        if not finished:
            raise RuntimeError(f"trainer exited {code}; last lines of {log}:\n" + log.read_text()[-3000:])
        # training finished and rank 0 logged "done:", then a rank aborted at exit ("terminate called without
        # an active exception", seen in ~1 of 4 two-rank gloo runs): keep the figures, record the exit
        TEARDOWN_CRASHES.append(f"{run_dir.name}: exit {code} after training finished")
        print(f"warning: {TEARDOWN_CRASHES[-1]} (see {log})", file=sys.stderr)
    return rows


TEARDOWN_CRASHES: list[str] = []


def child_env() -> dict[str, str]:
    """This environment (NCCL switches untouched) with the repository importable and, unless set,
    OMP_NUM_THREADS=1: what klppo.parallel.launch gives each of K ranks, so the 1-process runs match."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def compare_steps(rows_k: list[dict], rows_1: list[dict], *, rel: float) -> list[dict]:
    """Per step and metric of :data:`SMOKE_METRICS`: pass when ``|a-b| <= rel·max(|a|,|b|) + abs_tol``."""
    by_k, by_1 = ({r["step"]: r for r in rows} for rows in (rows_k, rows_1))
    out = []
    for step in sorted(set(by_k) & set(by_1)):
        for key, abs_tol in SMOKE_METRICS.items():
            if key not in by_k[step] or key not in by_1[step]:
                continue
            a, b = float(by_k[step][key]), float(by_1[step][key])
            diff = abs(a - b)
            ok = diff <= rel * max(abs(a), abs(b)) + abs_tol
            out.append(
                {
                    "step": step,
                    "metric": key,
                    "k_procs": a,
                    "one_proc": b,
                    "abs_diff": diff,
                    "rel_diff": diff / max(abs(a), abs(b), 1e-30),
                    "abs_tol": abs_tol,
                    "ok": ok,
                }
            )
    return out


def run_smoke(args, root: Path) -> dict:
    from klppo.data.arithmetic import write_arithmetic_parquet

    model_dir = make_model_dir(root, "Qwen2.5-0.5B", tiny=args.tiny, device=args.device)
    batch = 4 if args.tiny else 16  # divisible by 2, 4, 8
    data = write_arithmetic_parquet(root / "arith", num_train=batch * args.smoke_steps, num_test=8, seed=0)
    reward = root / "smoke_reward.py"
    reward.write_text(SMOKE_REWARD)
    fp32 = args.device == "cpu" or args.smoke_dtype == "fp32"
    rel = 1e-4 if args.device == "cpu" else (1e-3 if fp32 else 2e-2)
    extra = [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.rollout.do_sample=False",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"critic.ppo_mini_batch_size={batch}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "critic.forward_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "critic.optim.lr=1e-5",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "critic.model.enable_gradient_checkpointing=False",
        "trainer.seed=1",
        f"custom_reward_function.path={reward}",
    ]
    if fp32 and args.device == "cuda":
        extra += [
            f"{role}.fsdp_config.mixed_precision.param_dtype=fp32"
            for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
        ]
        extra += ["actor_rollout_ref.ref.fsdp_config.model_dtype=fp32"]
    kw = dict(
        batch=batch,
        n=1,
        prompt_len=64,
        response_len=8 if args.tiny else 32,
        steps=args.smoke_steps,
        extra=extra,
    )
    rows, wall = {}, {}
    for k in (args.gpus, 1):
        run_dir = root / f"smoke_{k}"
        t0 = time.perf_counter()
        rows[k] = run_trainer(trainer_argv(model_dir, data, run_dir, args, k=k, **kw), run_dir)
        wall[k] = time.perf_counter() - t0
    table = compare_steps(rows[args.gpus], rows[1], rel=rel)
    return {
        "dtype": "fp32" if fp32 else "bf16",
        "rel_tol": rel,
        "ok": bool(table) and all(r["ok"] for r in table),
        "world_sizes": sorted({r.get("perf/world_size") for r in rows[args.gpus] if "perf/world_size" in r}),
        "compared": table,
        "wall_s": {f"{k} procs": v for k, v in wall.items()},
        "rows_k": rows[args.gpus],
        "rows_1": rows[1],
    }


def run_scaling(args, root: Path) -> dict:
    """One trainer run at K = ``--gpus``; with ``--variant`` or ``--scaling-ks``, every variant at every K
    of ``--scaling-ks`` (default ``--gpus``) in this one call (same commit, same machine), in the order
    variant by variant, K by K: ``{"variants": [one run's result + variant, overrides, k]}``."""
    if not args.variant and not args.scaling_ks:
        return _scaling_run(args, root, args.gpus, [], "")
    ks = args.scaling_ks or [args.gpus]
    runs = []
    for name, overrides in args.variant or [("default", [])]:
        for k in ks:
            print(f"scaling: variant {name}, K={k}", flush=True)
            try:
                result = _scaling_run(args, root, k, overrides, name)
                result.pop("rows")  # the last row is kept; all rows are in the run directory's metrics.jsonl
            except Exception as e:  # one failed variant must not lose the others
                result = {"error": f"{type(e).__name__}: {e}"}
            runs.append({"variant": name, "overrides": overrides, "k": k, **result})
    return {"shape": "tiny" if args.tiny else args.scaling_shape, "variants": runs}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME`` or ``NAME:key=value key=value ...`` (trainer overrides, space-separated)."""
    name, _, overrides = text.partition(":")
    if not name or any("=" not in o for o in overrides.split()):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected NAME or NAME:key=value [key=value ...]"
        )
    return name, overrides.split()


def _scaling_run(args, root: Path, k: int, overrides: list[str], tag: str) -> dict:
    model_dir = make_model_dir(root, args.scaling_shape, tiny=args.tiny, device=args.device)
    batch = args.prompts_per_gpu * k
    data = _prompts(root, model_dir, args, batch)
    mini = max(1, batch // 4)  # 4 mini-batches per step, as bench/ppo_step.py
    extra = [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"critic.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro}",
        f"critic.ppo_micro_batch_size_per_gpu={args.micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={2 * args.micro}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={2 * args.micro}",
        f"critic.forward_micro_batch_size_per_gpu={2 * args.micro}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "critic.model.enable_gradient_checkpointing=False",
        *overrides,
    ]
    run_dir = root / f"scaling_{k}{'_' + tag if tag else ''}"
    argv = trainer_argv(
        model_dir,
        data,
        run_dir,
        args,
        k=k,
        batch=batch,
        n=args.n,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        steps=args.steps,
        extra=extra,
    )
    rows = run_trainer(argv, run_dir)
    return {
        "shape": "tiny" if args.tiny else args.scaling_shape,
        "train_batch_size": batch,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "last": rows[-1],
        "steady": _steady(rows),
        "rows": rows,
    }


def _steady(rows: list[dict]) -> dict:
    """Per metric, the median over the steps after the first (the first compiles and warms up; one step
    alone varies by ~10% between identical runs); all steps if only one."""
    import statistics

    steps = rows[1:] or rows
    keys = [k for k, v in steps[0].items() if isinstance(v, (int, float)) and all(k in r for r in steps)]
    return {k: statistics.median(float(r[k]) for r in steps) for k in keys}


def _prompts(root: Path, model_dir: Path, args, batch: int) -> tuple[Path, Path]:
    """Prompts of exactly ``--prompt-len`` chat-templated tokens (bench/ppo_step.py's builder)."""
    from bench.ppo_step import make_prompts

    folder = root / f"prompts_{model_dir.name}_{batch}"
    folder.mkdir(parents=True, exist_ok=True)
    path = make_prompts(folder, model_dir, prompt_len=args.prompt_len, rows=batch * args.steps)
    return path, path


def run_offload(args, root: Path) -> dict:
    k = args.gpus
    model_dir = make_model_dir(root, args.offload_shape, tiny=args.tiny, device=args.device)
    batch = args.offload_prompts_per_gpu * k
    data = _prompts(root, model_dir, args, batch)
    results = {}
    report = {"shape": "tiny" if args.tiny else args.offload_shape, "train_batch_size": batch, "n": args.n}
    modes = (True, False)  # the recipe first: a call cut short keeps its figures
    for on in modes:
        flag = str(on)
        extra = [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=True",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.offload_micro}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={2 * args.offload_micro}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={2 * args.offload_micro}",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            f"actor_rollout_ref.actor.fsdp_config.param_offload={flag}",
            f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={flag}",
            f"actor_rollout_ref.ref.fsdp_config.param_offload={flag}",
        ]
        run_dir = root / f"offload_{k}_{'on' if on else 'off'}"
        argv = trainer_argv(
            model_dir,
            data,
            run_dir,
            args,
            k=k,
            batch=batch,
            n=args.n,
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            steps=args.steps,
            extra=extra,
        )
        try:
            rows = run_trainer(argv, run_dir)
            results["on" if on else "off"] = {"last": rows[-1], "rows": rows}
        except RuntimeError as e:  # an OOM without offload is a result, not a reason to lose the other run
            results["on" if on else "off"] = {"error": str(e)[-1500:]}
        # another run follows: a timeout in it keeps this one (main writes the whole file at the end)
        if len(results) < len(modes):
            partial = {
                "meta": dict(machine_meta(args, "offload"), partial=True),
                "result": {**report, "results": results},
            }
            write_json(args.out, f"offload_k{k}.json", partial)
    return {**report, "results": results}


# ---------------------------------------------------------------- sweep (every rank runs this)


def sweep_ranks(args) -> None:
    """All ranks: :func:`measure_point` over the grid; rank 0 writes ``sweep_k{K}.json`` after every point
    (a run cut short keeps what it measured). Figures are the max over ranks; a point fails when any rank's
    does (an OOM on one rank only would leave the others waiting in a collective until the timeout)."""
    import torch
    import torch.distributed as dist

    from klppo.parallel.dist import destroy, init_distributed
    from klppo.tune.comm import probe_bandwidth
    from klppo.tune.measure import measure_point, safe_measure
    from klppo.tune.memory import Point, Workload, predict
    from klppo.tune.units import ModelFacts

    info = init_distributed(args.device, 600.0)
    shapes = ["tiny"] if args.tiny else args.sweep_shapes.split(",")
    cuda = info.device.type == "cuda"
    result = {"meta": dict(machine_meta(args, "sweep"), world_size=info.world_size), "rows": []}
    try:
        # the link the exposed communication is judged against: all-gather bus bandwidth (GB/s) by size
        sizes = (2**20,) if args.tiny else (64 * 2**20, 512 * 2**20)
        result["meta"]["all_gather_bus_gbps"] = {
            f"{n >> 20} MiB": probe_bandwidth(n) / 1e9 if info.world_size > 1 else None for n in sizes
        }
        if info.rank == 0:
            print("all-gather bus bandwidth:", result["meta"]["all_gather_bus_gbps"], flush=True)
        for name in shapes:
            facts = ModelFacts.from_config(model_config(name, args.tiny))
            device_bytes = torch.cuda.get_device_properties(info.device).total_memory if cuda else 80 * 2**30
            w = Workload(
                world_size=info.world_size,
                grad_checkpointing=True,
                device_bytes=device_bytes,
                compute_bytes=2 if cuda else 4,
            )
            for mnp in args.thresholds:
                for prefetch in (False, True):
                    for reshard in (True, False):
                        p = Point(mnp, "off", prefetch, reshard, args.micro_tokens)
                        m = safe_measure(
                            lambda p=p, facts=facts, w=w: measure_point(
                                facts.config,
                                p,
                                w,
                                device=info.device,
                                steps=args.sweep_steps,
                                num_micro=2,
                                seq_len=args.seq_len,
                                profile=True,
                            ),
                            p,
                            info.device,
                        )
                        vals = [m.peak_bytes, m.step_s, m.exposed_comm_s, m.comm_s, float(m.status != "ok")]
                        t = torch.tensor(
                            [-1.0 if math.isnan(v) else v for v in vals],
                            dtype=torch.float64,
                            device=info.device,
                        )
                        dist.all_reduce(t, op=dist.ReduceOp.MAX)
                        peak, step_s, exposed, comm, failed = (None if v < 0 else v for v in t.tolist())
                        row = {
                            "shape": name,
                            "params": facts.num_params,
                            "min_num_params": mnp,
                            "units": facts.units(mnp).count,
                            "forward_prefetch": prefetch,
                            "reshard_after_forward": reshard,
                            "status": m.status
                            if m.status != "ok"
                            else ("failed on another rank" if failed else "ok"),
                            "note": m.note,
                            "peak_gib": peak / 2**30 if peak is not None else None,
                            "predicted_gib": predict(facts, p, w)["update"].total / 2**30,
                            "update_s": step_s,
                            "comm_s": comm,
                            "exposed_comm_s": exposed,
                            "exposed_share": exposed / step_s if exposed is not None and step_s else None,
                            "micro_tokens": args.micro_tokens,
                            "num_micro": 2,
                            "seq_len": args.seq_len,
                        }
                        result["rows"].append(row)
                        if info.rank == 0:
                            write_json(args.out, f"sweep_k{info.world_size}.json", result)
                            print(json.dumps(row), flush=True)
    finally:
        destroy()


def run_sweep(args, root: Path) -> dict | None:
    """Relaunch this script under torchrun (K ranks) to run :func:`sweep_ranks`, or run it here for K = 1.

    The ranks get one argument, ``sweep_args=FILE`` (this run's arguments as JSON): torchrun's own parser
    would take ``--run`` for an abbreviation of its ``--run-path``."""
    from klppo.parallel.launch import maybe_relaunch

    spec = root / "sweep_args.json"
    root.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}))
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]  # torchrun's `-m bench.multi_gpu` needs the root
    code = maybe_relaunch(
        [f"sweep_args={spec}"],
        nproc_per_node=args.gpus,
        nnodes=1,
        module="bench.multi_gpu",
        use_gpus=args.device == "cuda",
    )
    if code is None:
        sweep_ranks(args)
    elif code != 0:
        raise RuntimeError(f"sweep ranks exited {code}")
    return None  # rank 0 wrote sweep_k{K}.json


# ---------------------------------------------------------------- tables


def _f(x, fmt: str = "{:.3f}") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def memory_error(row: dict) -> float | None:
    """(predicted − measured) / measured peak of one sweep point; None where nothing was measured."""
    peak = row.get("peak_gib")
    if row.get("status") != "ok" or not peak:
        return None
    return row["predicted_gib"] / peak - 1


def memory_check(sweep: list[dict], tolerance: float = 0.10) -> list[str]:
    """Per shape and K: how far the memory model (fixed before these runs, so every point is out of
    sample) lands from the measured peaks — the largest |error| and the points within ``tolerance``."""
    lines = []
    for shape, k in sorted({(r["shape"], r["k"]) for r in sweep}):
        errors = [
            e for r in sweep if (r["shape"], r["k"]) == (shape, k) if (e := memory_error(r)) is not None
        ]
        if not errors:
            continue
        worst = max(errors, key=abs)
        within = sum(abs(e) <= tolerance for e in errors)
        lines.append(
            f"- memory model, {shape}, K={k}: largest error {worst:+.1%}; {within} of {len(errors)} points "
            f"within ±{tolerance:.0%}{'' if within == len(errors) else ' — NOT all'}"
        )
    return lines


def summarize(folder: Path) -> str:
    """Markdown tables (for docs/performance.md) of every ``*_k*.json`` under ``folder``."""
    files = [json.loads(p.read_text()) for p in sorted(Path(folder).rglob("*_k*.json"))]
    by_run: dict[str, list[dict]] = {r: [] for r in RUNS}
    for f in files:
        by_run.setdefault(f["meta"]["run"], []).append(f)
    out = []
    for f in by_run["smoke"]:
        r, k = f.get("result", {}), f["meta"]["gpus"]
        if "error" in r:
            out.append(f"smoke K={k}: error: {r['error'][-300:]}")
            continue
        worst = max(
            r["compared"],
            key=lambda c: (
                c["abs_diff"]
                / (r["rel_tol"] * max(abs(c["one_proc"]), abs(c["k_procs"])) + c["abs_tol"] + 1e-30)
            ),
        )
        out += [
            f"\n**Smoke, {k} processes vs 1** ({r['dtype']}, rel tol {r['rel_tol']:g}): "
            f"{'PASS' if r['ok'] else 'FAIL'}; worst: {worst['metric']} step {worst['step']}\n",
            "| step | metric | 1 process | K processes | rel diff | abs tol | ok |",
            "|---|---|---|---|---|---|---|",
        ]
        out += [
            f"| {c['step']} | {c['metric']} | {c['one_proc']:.6g} | {c['k_procs']:.6g} | {c['rel_diff']:.2e} "
            f"| {c['abs_tol']:g} | {'yes' if c['ok'] else '**no**'} |"
            for c in r["compared"]
        ]
    sweep = [
        row | {"k": f["meta"].get("world_size", f["meta"]["gpus"])}
        for f in by_run["sweep"]
        for row in f.get("rows", [])
    ]
    out += [f"sweep K={f['meta']['gpus']}: {f['result']['error']}" for f in by_run["sweep"] if "result" in f]
    if sweep:
        out += [
            "\n**Sharding sweep** (actor update; peak and times: max over ranks)\n",
            "| shape | K | min_num_params | units | fwd prefetch | reshard | peak GiB/GPU | predicted GiB "
            "| error | update s | comm s | exposed comm s | exposed share |",
            "|---" * 13 + "|",
        ]
        for s in sorted(sweep, key=lambda s: (s["shape"], s["k"])):
            status = "" if s["status"] == "ok" else f" ({s['status']}: {s['note'][:60]})"
            out.append(
                f"| {s['shape']} | {s['k']} | {s['min_num_params']:.0e}{status} | {s['units']} | "
                f"{'on' if s['forward_prefetch'] else 'off'} | "
                f"{'on' if s['reshard_after_forward'] else 'off'} | "
                f"{_f(s['peak_gib'], '{:.1f}')} | {s['predicted_gib']:.1f} | "
                f"{_f(memory_error(s), '{:+.1%}')} | "
                f"{_f(s['update_s'])} | "
                f"{_f(s['comm_s'])} | {_f(s['exposed_comm_s'])} | {_f(s['exposed_share'], '{:.1%}')} |"
            )
        out += memory_check(sweep)
    out.append(scaling_table(by_run["scaling"]))
    for f in by_run["offload"]:
        r = f.get("result", {})
        out += [
            f"\n**Offload**, {r.get('shape')}, K={f['meta']['gpus']}, {r.get('train_batch_size')} prompts x "
            f"n {r.get('n')}\n",
            "| offload | step s | update_actor s | gen s | max mem GiB/GPU | rollout peak GiB |",
            "|---|---|---|---|---|---|",
        ]
        for mode, res in r.get("results", {}).items():
            last = res.get("last", {})
            if "error" in res:
                out.append(f"| {mode} | error: {res['error'].splitlines()[-1][:120]} | | | | |")
                continue
            out.append(
                f"| {mode} | {_f(last.get('timing_s/step'))} | {_f(last.get('timing_s/update_actor'))} | "
                f"{_f(last.get('timing_s/gen'))} | {_f(last.get('perf/max_memory_allocated_gb'), '{:.1f}')} "
                f"| "
                f"{_f(last.get('perf/rollout_peak_memory_gb'), '{:.1f}')} |"
            )
    return "\n".join(x for x in out if x)


def _variant_files(files: list[dict]) -> list[dict]:
    """The runs of ``--variant`` files as one-run files (shape ``SHAPE [variant]``); others as they are."""
    out = []
    for f in files:
        r = f.get("result", {})
        if "variants" not in r:
            out.append(f)
            continue
        for v in r["variants"]:
            if "last" in v:
                shape = f"{v['shape']} [{v['variant']}]"
                out.append({"meta": dict(f["meta"], gpus=v["k"]), "result": dict(v, shape=shape)})
    return out


def scaling_table(files: list[dict]) -> str:
    """efficiency(K) = T(K) / (K·T(1)) for total throughputs T = perf/throughput (per GPU) x K, i.e. the
    per-GPU throughput ratio; needs the K = 1 run of the same shape (and variant)."""
    files = _variant_files(files)
    rows = sorted((f for f in files if "last" in f.get("result", {})), key=lambda f: f["meta"]["gpus"])
    if not rows:
        return ""

    def pick(r: dict) -> dict:  # files without a median hold the last step only
        return r.get("steady") or r["last"]

    base = {
        f["result"]["shape"]: pick(f["result"])["perf/throughput"] for f in rows if f["meta"]["gpus"] == 1
    }
    what = (
        "median of the steps after the first" if all("steady" in f["result"] for f in rows) else "last step"
    )
    out = [
        f"\n**Scaling** (end-to-end PPO step, {what})\n",
        "| shape | K | train_batch_size | step s | gen s | rank_wait s | update_actor s | update_critic s "
        "| tokens/s/GPU | efficiency | max mem GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in rows:
        r, k = f["result"], f["meta"]["gpus"]
        last, one = pick(r), base.get(r["shape"])
        eff = last["perf/throughput"] / one if one else None
        out.append(
            f"| {r['shape']} | {k} | {r['train_batch_size']} | {_f(last.get('timing_s/step'))} | "
            f"{_f(last.get('timing_s/gen'))} | {_f(last.get('timing_s/rank_wait'))} | "
            f"{_f(last.get('timing_s/update_actor'))} | {_f(last.get('timing_s/update_critic'))} | "
            f"{last['perf/throughput']:,.0f} | {_f(eff, '{:.2f}')} | "
            f"{_f(last.get('perf/max_memory_allocated_gb'), '{:.1f}')} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=[*RUNS, "all"], default="all")
    p.add_argument("--gpus", type=int, default=1, help="processes (GPUs) K")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small batches (CPU mechanics)")
    p.add_argument("--out", type=Path, default=Path("multi_gpu_out"))
    p.add_argument("--summarize", type=Path, default=None, help="print the tables of the JSON files in DIR")
    p.add_argument("--work-dir", type=Path, default=None, help="model and run dirs (default: a temp dir)")
    p.add_argument("--rollout", default="klppo", help="rollout engine of the trainer runs (klppo | hf)")
    p.add_argument("--smoke-steps", type=int, default=3)
    p.add_argument(
        "--smoke-dtype", choices=["bf16", "fp32"], default="bf16", help="GPU compute dtype of smoke"
    )
    # (full, --tiny) defaults
    sizes = {
        "steps": (3, 2),
        "prompts_per_gpu": (32, 4),
        "offload_prompts_per_gpu": (8, 2),
        "n": (4, 2),
        "prompt_len": (512, 32),
        "response_len": (512, 16),
        "micro": (16, 2),
        "offload_micro": (4, 2),
        "micro_tokens": (8192, 256),
        "seq_len": (1024, 64),
    }
    for name in sizes:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    p.add_argument(
        "--sweep-steps",
        type=int,
        default=5,
        help="timed steps per sweep point (median; 2 are too few to rank the points)",
    )
    p.add_argument("--thresholds", default=None, help="comma list (default 0,1e7,1e8,whole)")
    p.add_argument("--sweep-shapes", default="Qwen2.5-1.5B,Qwen2.5-7B")
    p.add_argument("--scaling-shape", default="Qwen2.5-0.5B")
    p.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        default=None,
        help="scaling: NAME or NAME:key=value ... (trainer overrides); repeat for before/after in one call",
    )
    p.add_argument(
        "--scaling-ks",
        default=None,
        help="scaling: comma list of K run in this call (default --gpus), e.g. 1,2",
    )
    p.add_argument("--offload-shape", default="Qwen2.5-7B")
    args = p.parse_args(argv)
    for name, (full, tiny) in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    default = TINY_THRESHOLDS if args.tiny else THRESHOLDS
    args.thresholds = [int(float(t)) for t in args.thresholds.split(",")] if args.thresholds else default
    args.scaling_ks = [int(k) for k in args.scaling_ks.split(",")] if args.scaling_ks else None
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    import traceback

    from klppo.parallel.dist import under_launcher

    argv = list(sys.argv[1:] if argv is None else argv)
    if under_launcher():  # a rank started by run_sweep's torchrun
        if len(argv) != 1 or not argv[0].startswith("sweep_args="):
            raise SystemExit(
                "under torchrun only run_sweep's `sweep_args=FILE` runs; start with --gpus K instead"
            )
        spec = json.loads(Path(argv[0].split("=", 1)[1]).read_text())
        sweep_ranks(argparse.Namespace(**dict(spec, out=Path(spec["out"]))))
        return 0
    args = parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    runs = RUNS if args.run == "all" else (args.run,)
    root = args.work_dir or Path(tempfile.mkdtemp(prefix="klppo_multi_gpu_"))
    fns = {"smoke": run_smoke, "sweep": run_sweep, "scaling": run_scaling, "offload": run_offload}
    failed = []
    for run in runs:
        if run == "smoke" and args.gpus == 1:
            print("smoke: skipped for K=1 (it compares K processes with 1)")
            continue
        t0 = time.perf_counter()
        TEARDOWN_CRASHES.clear()
        try:
            result = fns[run](args, root)
        except Exception as e:  # one failed run must not lose the others
            traceback.print_exc()
            failed.append(run)
            result = {"error": f"{type(e).__name__}: {e}"}
        print(f"== {run}: {time.perf_counter() - t0:.0f} s{' (FAILED)' if run in failed else ''}", flush=True)
        if result is not None:
            meta = dict(
                machine_meta(args, run),
                wall_s=time.perf_counter() - t0,
                teardown_crashes=list(TEARDOWN_CRASHES),
            )
            write_json(args.out, f"{run}_k{args.gpus}.json", {"meta": meta, "result": result})
        if run == "smoke" and result.get("ok") is False:
            failed.append(run)
    print(summarize(args.out))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
