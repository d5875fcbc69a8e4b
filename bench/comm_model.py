"""``klppo tune``'s communication model against a measured sharding sweep (CPU only, no device).

    PYTHONPATH=$PWD python3 bench/comm_model.py bench/results/fsdp-sweep-2gpu-1.5b.json \
        --link-gbps 25 350 [--tflops 600] [--set key=value ...]

For every row of a ``bench/multi_gpu.py --run sweep`` file (one sharding point: ``min_num_params``,
forward prefetch, reshard after forward, the actor's token budget, its number of micro-batches) the model
predicts the share of one micro-batch's update pass spent in exposed communication
(:func:`klppo.tune.comm.predict_units`, as ``klppo tune --dry-run --profile`` prints it) at each assumed
link bus bandwidth, beside the measured share (``exposed_share``: exposed NCCL time over the update, from
the profiler). One fitted number, the bandwidth; its value on the machine is what the sweep's
``all_gather_bus_gbps`` or NCCL's own timing say. ``--set`` adds config
overrides to every row (e.g. ``actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16``:
what the model predicts for a variant the sweep did not run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

A = "actor_rollout_ref.actor"


def row_overrides(row: dict) -> list[str]:
    """The actor configuration of one sweep row (one mini-batch of ``num_micro`` micro-batches). The sweep's
    step (``klppo.tune.measure.actor_step``) reduce-scatters after every micro-batch's backward: the
    gradient sync is not deferred to the mini-batch's end, so neither is it here."""
    return [
        f"{A}.fsdp_config.grad_sync_per_mini_batch=False",
        f"{A}.fsdp_config.wrap_policy.min_num_params={row['min_num_params']}",
        f"{A}.fsdp_config.forward_prefetch={row['forward_prefetch']}",
        f"{A}.fsdp_config.reshard_after_forward={row['reshard_after_forward']}",
        f"{A}.use_dynamic_bsz=True",
        f"{A}.ppo_max_token_len_per_gpu={row['micro_tokens']}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    ]


def predicted_share(
    row: dict, *, world_size: int, link_gbps: float, tflops: float, extra: list[str]
) -> float:
    """Exposed communication / (compute + exposed) of one micro-batch, as ``klppo tune`` reports it."""
    from klppo.commands.tune import workload_from
    from klppo.config import load_config
    from klppo.tune.comm import predict_units
    from klppo.tune.shapes import load_model_config
    from klppo.tune.units import ModelFacts

    cfg = load_config(row_overrides(row) + extra)
    tw = workload_from(cfg, 141.0, world_size)
    facts = ModelFacts.from_config(load_model_config(row["shape"]))
    point = tw.point
    units = predict_units(
        facts.units(point.min_num_params),
        point,
        tw.workload,
        bus_bandwidth=link_gbps * 1e9,
        flops_per_s=tflops * 1e12,
        num_micro=int(row["num_micro"]),
    )
    exposed = sum(u.exposed_s for u in units)
    return exposed / max(sum(u.compute_s for u in units) + exposed, 1e-12)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep", type=Path, help="a bench/multi_gpu.py --run sweep JSON file")
    p.add_argument("--link-gbps", type=float, nargs="+", default=[25.0, 350.0])
    p.add_argument("--tflops", type=float, default=600.0)
    p.add_argument("--set", nargs="*", default=[], help="config overrides added to every row")
    p.add_argument("--rows", type=int, default=None, help="only the first N rows")
    args = p.parse_args(argv)
    data = json.loads(args.sweep.read_text())
    world = int(data["meta"].get("world_size") or data["meta"]["gpus"])
    rows = [r for r in data["rows"] if r.get("status") == "ok"][: args.rows]
    head = ["shape", "min_num_params", "units", "fwd prefetch", "reshard", "measured"]
    print("| " + " | ".join(head + [f"predicted @ {g:g} GB/s" for g in args.link_gbps]) + " |")
    print("|" + " --- |" * (len(head) + len(args.link_gbps)))
    for r in rows:
        preds = [
            predicted_share(r, world_size=world, link_gbps=g, tflops=args.tflops, extra=args.set)
            for g in args.link_gbps
        ]
        cells = [
            r["shape"],
            f"{r['min_num_params']:.0e}",
            str(r["units"]),
            str(r["forward_prefetch"]),
            str(r["reshard_after_forward"]),
            f"{100 * r['exposed_share']:.0f}%",
        ]
        print("| " + " | ".join(cells + [f"{100 * s:.0f}%" for s in preds]) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
