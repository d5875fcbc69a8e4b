"""``klppo tune CONFIG [overrides] --budget-minutes N [--dry-run] [--model-shape NAME] [--out DIR]``.

Reads the training configuration (verl keys), builds the actor's shape (``--model-shape`` or
``actor_rollout_ref.model.path``) on the meta device, and either prints the memory model (``--dry-run``:
no GPU; the device's peak per phase, the host memory the offload needs, the refusal a run would meet, one
checkpoint's size per setting) or sweeps the grid with short real steps (:mod:`klppo.tune.grid`,
:mod:`klppo.tune.measure`),
then prints the ranked table, writes ``tune.png`` and ``results.json`` into ``--out``, and prints the
overrides of the best point that fits. Several GPUs: run under torchrun (every rank runs the sweep).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.text import Text

from klppo.assembly.settings import fsdp_settings, tune_workload
from klppo.assembly.startup_checks import checkpoint_roles, free_space
from klppo.config import ConfigError, KLPPOConfig, load_config, uses_critic
from klppo.config.flags import FlagParser
from klppo.parallel.dist import init_distributed
from klppo.tune import disk, report
from klppo.tune.comm import matmul_rate, predict_units, probe_bandwidth
from klppo.tune.critic import run_phases
from klppo.tune.grid import DEFAULT_THRESHOLDS, build_grid, describe, order, run_sweep
from klppo.tune.host import host_peak, host_ram_bytes, refusal
from klppo.tune.measure import measure_point, safe_measure
from klppo.tune.memory import OFFLOAD_MODES, Point, TuneWorkload, Workload, predict
from klppo.tune.shapes import load_model_config, shape_names
from klppo.tune.units import ModelFacts


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = FlagParser(prog="klppo tune", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="*", help="config.yaml and/or dotted key=value overrides (verl keys)")
    p.add_argument("--budget-minutes", type=float, default=10.0, help="stop measuring after this long")
    p.add_argument("--dry-run", action="store_true", help="print the memory model only (no GPU needed)")
    p.add_argument("--model-shape", help=f"named shape instead of model.path: {', '.join(shape_names())}")
    p.add_argument("--out", default="tune_out", help="directory for results.json and tune.png")
    p.add_argument(
        "--thresholds",
        default=",".join(str(t) for t in DEFAULT_THRESHOLDS),
        help="min_num_params values (comma separated)",
    )
    p.add_argument(
        "--offload",
        default=None,
        help=f"offload modes among {OFFLOAD_MODES} (default: off,idle; --dry-run: and the configured one)",
    )
    p.add_argument("--micro-tokens", default=None, help="token budgets (default: ½×, 1× the configured)")
    p.add_argument("--headroom", type=float, default=0.9, help="usable fraction of device memory")
    p.add_argument("--device-gb", type=float, default=None, help="device memory (default: the GPU's; 80)")
    p.add_argument(
        "--host-gb",
        type=float,
        default=None,
        help="--dry-run: host memory per process (default: this machine's, shared by a node's processes)",
    )
    p.add_argument("--world-size", type=int, default=None, help="ranks for --dry-run (default: config's)")
    p.add_argument("--num-micro", type=int, default=2, help="micro-batches per measured step")
    p.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: prompt+response)")
    p.add_argument("--profile", action="store_true", help="profile exposed communication on one rank too")
    p.add_argument(
        "--link-gbps",
        type=float,
        default=350.0,
        help="--dry-run: assumed all-gather bus bandwidth, GB/s (the default: NVLink between data-centre "
        "GPUs)",
    )
    p.add_argument(
        "--tflops",
        type=float,
        default=600.0,
        help="--dry-run: assumed sustained bf16 matmul rate, TFLOP/s (the default: a data-centre GPU)",
    )
    return p.parse_args(argv)


def workload_from(
    cfg: KLPPOConfig, device_gb: float | None, world_size: int, *, critic_config: object | None = None
) -> TuneWorkload:
    """The run's workload from the configuration, with the FSDP settings as the trainer builds them;
    ``device_gb`` None: this GPU's memory, else 80; ``critic_config``: the critic's model where it is not
    the actor's (:func:`critic_config_of`)."""
    if device_gb is None:
        device_gb = (
            torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 80
        )
    fsdp = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type="cuda", world_size=world_size)
    return tune_workload(cfg, fsdp, world_size=world_size, device_gib=device_gb, critic_config=critic_config)


def critic_config_of(cfg: KLPPOConfig, actor_name: str) -> object | None:
    """The model config of ``critic.model.path`` (a model directory or a named shape, as the actor's) where
    the run has a critic on another model than ``actor_name``; None: no critic, or the actor's backbone."""
    path = cfg.critic.model.path
    if not uses_critic(cfg) or not path or path == cfg.actor_rollout_ref.model.path or path == actor_name:
        return None
    try:
        return load_model_config(path)
    except ValueError as exc:
        raise ValueError(
            f"critic.model.path: not a model directory (config.json) nor a known shape: {exc}"
        ) from None


def _world_size(cfg: KLPPOConfig, args: argparse.Namespace) -> int:
    if args.world_size:
        return args.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    n = cfg.trainer.n_gpus_per_node
    if n == "auto":
        n = torch.cuda.device_count() or 1
    return int(n) * cfg.trainer.nnodes


@dataclass
class _Plan:
    """What the arguments ask for: the config, the actor's model and workload, the grid of points."""

    cfg: KLPPOConfig
    model_config: object
    model_path: str | None
    """The actor's model directory (None: a named shape)."""
    tw: TuneWorkload
    facts: ModelFacts
    points: list[Point]
    current: Point
    """The configured point as the trainer runs it."""

    @property
    def w(self) -> Workload:
        return self.tw.workload


def main(argv: list[str] | None = None) -> int:
    """`klppo tune`: a mistake in the arguments (a key, a value, a model, an option) is one line and exit 2;
    what fails during a sweep is not reported as one."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        plan = _plan(args)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"klppo tune: {exc}", file=sys.stderr)
        return 2
    console = Console(width=200)
    if plan.w.plain:
        console.print(report.PLAIN_NOTE)
    if args.dry_run:
        _dry_run(args, console, plan)
        return 0
    return _sweep(
        args, console, plan.facts, plan.points, plan.w, plan.current, args.seq_len or plan.tw.seq_len
    )


def _dry_run(args: argparse.Namespace, console: Console, plan: _Plan) -> None:
    """The memory model's tables: the grid (device and host), the terms at the configured point, what a run
    would be refused for, the per-unit communication (several ranks), and the checkpoint per setting."""
    facts, w, current = plan.facts, plan.w, plan.current
    world, nodes = w.world_size, plan.cfg.trainer.nnodes
    host = int(args.host_gb * 2**30) if args.host_gb else host_ram_bytes(max(1, world // nodes))
    console.print(report.memory_table(facts, plan.points, w, args.headroom, host_bytes=host))
    critic = {} if plan.tw.critic is None else run_phases(plan.tw, facts)
    phases = {
        **predict(facts, current, w),
        **{k: v for k, v in critic.items() if k in ("values", "update_critic")},
        "host": host_peak(facts, current, w, critic=plan.tw.critic),
    }
    console.print(report.terms_table(phases, current, w.runs_plain(current)))
    message = refusal(plan.tw, plan.model_config, host_bytes=host)
    if message:
        console.print(Text(f"a run is refused at its start: {message}", style="red"))
    if w.shard_ranks > 1:
        units = predict_units(
            facts.units(current.min_num_params),
            current,
            w,
            bus_bandwidth=args.link_gbps * 1e9,
            flops_per_s=args.tflops * 1e12,
            num_micro=args.num_micro,
        )
        console.print(report.comm_table(units, current, args.link_gbps, args.tflops))
    roles = checkpoint_roles(
        plan.cfg,
        plan.model_config,
        (plan.tw.critic.model_config or plan.model_config) if plan.tw.critic is not None else None,
        files_bytes=(disk.hf_files_bytes(plan.model_path),) * 2,
    )
    where, free = free_space(plan.cfg.trainer.default_local_dir)
    options = disk.settings(roles, ranks=world)
    console.print(report.checkpoint_table(options, free, where.resolve()))
    terms = report.terms_table(
        {"checkpoint": options[0][1]}, current, title="checkpoint terms", total="total"
    )
    console.print(terms)


def _plan(args: argparse.Namespace) -> _Plan:
    """The config, the model and the grid of points from the arguments; ValueError/ConfigError on a
    mistake."""
    cfg = load_config(args.config)
    name = args.model_shape or cfg.actor_rollout_ref.model.path
    try:
        model_config = load_model_config(name)
    except ValueError as exc:
        where = "--model-shape" if args.model_shape else "actor_rollout_ref.model.path"
        raise ValueError(f"{where}: not a model directory (config.json) nor a known shape: {exc}") from None
    critic_config = critic_config_of(cfg, name)
    tw = workload_from(cfg, args.device_gb, _world_size(cfg, args), critic_config=critic_config)
    w = tw.workload
    current = w.as_run(tw.point)  # on the plain path the grid's one point per (offload, tokens)
    facts = ModelFacts.from_config(model_config)
    tokens = (
        _numbers("--micro-tokens", args.micro_tokens)
        if args.micro_tokens
        else sorted({max(1024, current.micro_tokens // 2), current.micro_tokens})
    )
    thresholds = _numbers("--thresholds", args.thresholds)
    offloads = args.offload.split(",") if args.offload else ["off", "idle"]
    if not args.offload and args.dry_run and current.offload not in offloads:
        offloads.append(current.offload)
    try:
        points = build_grid(
            facts,
            thresholds=thresholds,
            offloads=offloads,
            micro_tokens=tokens,
            plain=w.plain,
            plain_offload=w.plain_offload,
        )
    except ValueError as exc:
        raise ValueError(f"--thresholds/--offload/--micro-tokens: {exc}") from None
    model_path = None if args.model_shape or not Path(name).expanduser().is_dir() else name
    return _Plan(cfg, model_config, model_path, tw, facts, points, current)


def _numbers(option: str, text: str) -> list[int]:
    try:
        return [int(float(t)) for t in text.split(",")]
    except (ValueError, OverflowError):
        raise ValueError(f"{option} {text!r}: expected comma-separated numbers") from None


def _sweep(
    args, console: Console, facts: ModelFacts, points: list[Point], w: Workload, current: Point, seq_len: int
) -> int:
    info = init_distributed("cuda" if torch.cuda.is_available() else "cpu", timeout_s=600)
    is_main = info.rank == 0

    def agree(x: float) -> float:
        t = torch.tensor([x], device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    profile = args.profile or info.world_size > 1
    bandwidth, rate = probe_bandwidth(), matmul_rate(info.device)

    def measure(p: Point):
        return safe_measure(
            lambda: measure_point(
                facts.config,
                p,
                w,
                device=info.device,
                steps=args.steps,
                num_micro=args.num_micro,
                seq_len=seq_len,
                profile=profile,
            ),
            p,
            info.device,
        )

    results = run_sweep(
        facts,
        order(points, current if current in points else None),
        w,
        measure=measure,
        budget_s=args.budget_minutes * 60,
        headroom=args.headroom,
        agree=agree,
        log=console.print if is_main else (lambda s: None),
    )
    if not is_main:
        return 0
    ranked = report.rank(facts, results, w, args.headroom, args.num_micro)
    console.print(report.results_table(ranked, args.num_micro, w.device_bytes, w))
    console.print(f"link bus bandwidth {bandwidth / 1e9:.1f} GB/s, matmul {rate / 1e12:.1f} TFLOP/s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            [dict(asdict(m), need_bytes=need, fits=fit) for m, need, fit in ranked],
            indent=1,
            default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x),
        )
    )
    try:
        console.print(
            f"plot: {report.plot(ranked, args.num_micro, out / 'tune.png', w.device_bytes, args.headroom)}"
        )
    except RuntimeError as e:
        console.print(f"[yellow]no plot: {e}[/yellow]")
    pick = report.best(ranked, args.num_micro)
    if pick is None:
        console.print("[red]no measured point fits the device with the headroom asked[/red]")
        return 1
    plain = w.runs_plain(pick.point)
    console.print(f"best point that fits ({describe(pick.point, plain)}); paste these overrides:")
    print(" \\\n".join(report.overrides(pick.point, plain)))
    return 0
