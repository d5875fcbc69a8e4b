"""Output of ``klppo tune``: ranked table, memory-model table, Pareto plot, ready-to-paste overrides.

Ranking: measured points that fit (:func:`klppo.tune.grid.training_need` with the measured update
peak ≤ headroom × device, and room left for a KV cache) by throughput ``tokens/s = num_micro · micro_tokens /
step_s``, fastest first; then measured points that do not fit, OOMs, skipped points.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from klppo.tune.grid import describe, rule_out, training_need
from klppo.tune.host import host_peak
from klppo.tune.measure import Measurement
from klppo.tune.memory import PhasePeak, Point, Workload, kv_cache_room, predict
from klppo.tune.units import WHOLE_MODEL, ModelFacts

GiB = 2**30
FSDP_KEY = "actor_rollout_ref.actor.fsdp_config"
PLAIN_NOTE = (
    "one process: no FSDP2 (fsdp_config.plain_single_gpu); min_num_params, prefetch and reshard do not apply"
)
"""Said once when the workload runs the plain path (``Workload.plain``; offload=cpu points stay FSDP2, and so
do offload=idle points unless plain_single_gpu=true: ``Workload.runs_plain``)."""


def throughput(m: Measurement, num_micro: int) -> float:
    return num_micro * m.point.micro_tokens / m.step_s if m.status == "ok" else 0.0


def rank(
    facts: ModelFacts, results: list[Measurement], w: Workload, headroom: float, num_micro: int
) -> list[tuple[Measurement, float, bool]]:
    """(measurement, need bytes, fits) best first (module docstring)."""
    rows = []
    for m in results:
        measured = m.peak_bytes if m.status == "ok" and not math.isnan(m.peak_bytes) else None
        need = training_need(facts, m.point, w, measured)
        rows.append((m, need, m.status == "ok" and not rule_out(facts, m.point, w, headroom, measured)))
    status_order = {"ok": 0, "oom": 1, "error": 2, "skipped": 3}
    return sorted(rows, key=lambda r: (not r[2], status_order[r[0].status], -throughput(r[0], num_micro)))


SPEED_TIE = 0.03
"""Throughputs within 3% of the fastest count as equal (timing noise of short runs)."""


def best(ranked: list[tuple[Measurement, float, bool]], num_micro: int) -> Measurement | None:
    """The fitting point of least memory among those within :data:`SPEED_TIE` of the fastest fitting
    one (ties in memory, within 1%, go to the faster)."""
    fitting = [(m, need) for m, need, ok in ranked if ok]
    if not fitting:
        return None
    top = max(throughput(m, num_micro) for m, _ in fitting)
    near = [(m, need) for m, need in fitting if throughput(m, num_micro) >= (1 - SPEED_TIE) * top]
    least = min(need for _, need in near)
    return max((m for m, need in near if need <= 1.01 * least), key=lambda m: throughput(m, num_micro))


def _fsdp_cells(p: Point, plain: bool) -> tuple[str, str, str]:
    """min_num_params, forward_prefetch and reshard cells; "-" on the plain path, where they do not apply."""
    if plain:
        return "plain", "-", "-"
    return _threshold(p.min_num_params), _yn(p.forward_prefetch), _yn(p.reshard_after_forward)


def results_table(ranked, num_micro: int, device_bytes: float, w: Workload | None = None) -> Table:
    t = Table(
        title=f"klppo tune: actor update, {num_micro} micro-batches per step "
        f"(device {device_bytes / GiB:.0f} GiB)"
    )
    for col in (
        "#",
        "min_num_params",
        "offload",
        "fwd_prefetch",
        "reshard",
        "tokens",
        "step s",
        "tok/s",
        "update GiB meas.",
        "pred.",
        "err",
        "exposed comm ms",
        "need GiB",
        "fits",
        "note",
    ):
        t.add_column(col, justify="right" if col not in ("offload", "note") else "left")
    for i, (m, need, ok) in enumerate(ranked, 1):
        p = m.point
        meas = m.peak_bytes / GiB if m.status == "ok" else math.nan
        err = (
            (m.predicted_bytes - m.peak_bytes) / m.peak_bytes
            if m.status == "ok" and m.peak_bytes
            else math.nan
        )
        threshold, prefetch, reshard = _fsdp_cells(p, w is not None and w.runs_plain(p))
        t.add_row(
            str(i),
            threshold,
            p.offload,
            prefetch,
            reshard,
            str(p.micro_tokens),
            _f(m.step_s, 3),
            _f(throughput(m, num_micro), 0),
            _f(meas, 2),
            _f(m.predicted_bytes / GiB, 2),
            "" if math.isnan(err) else f"{err:+.0%}",
            _f(m.exposed_comm_s * 1e3, 1),
            _f(need / GiB, 1),
            "yes" if ok else "no",
            m.note if m.status != "ok" else "",
        )
    return t


def memory_table(
    facts: ModelFacts, points: list[Point], w: Workload, headroom: float, *, host_bytes: int | None = None
) -> Table:
    """Per point: the predicted peak of each device phase, the KV cache's room and, with ``host_bytes`` (one
    process's host memory), the host's peak (:func:`klppo.tune.host.host_peak`); a point fits when the device
    phases fit ``headroom`` of the device and the host its memory."""
    host_text = f", host {host_bytes / GiB:.0f} GiB" if host_bytes else ""
    t = Table(
        title=f"klppo tune --dry-run: predicted peak GiB per rank ({facts.shape.name}, "
        f"{facts.num_params / 1e9:.2f}B params, world {w.world_size}, device {w.device_bytes / GiB:.0f} GiB"
        f"{host_text})"
    )
    columns = ["min_num_params", "units", "offload", "fwd_prefetch", "reshard", "tokens"]
    columns += ["rollout", "log_prob", "update", "KV room", *(["host"] if host_bytes else []), "fits"]
    for col in columns:
        t.add_column(col, justify="left" if col == "offload" else "right")
    for p in points:
        ph = predict(facts, p, w)
        threshold, prefetch, reshard = _fsdp_cells(p, w.runs_plain(p))
        host = host_peak(facts, p, w).total if host_bytes else None
        fits = "no" if rule_out(facts, p, w, headroom) else "yes"
        if host is not None and host > host_bytes and fits == "yes":
            fits = "no (host)"
        t.add_row(
            threshold,
            "-" if w.runs_plain(p) else str(facts.units(p.min_num_params).count),
            p.offload,
            prefetch,
            reshard,
            str(p.micro_tokens),
            *(f"{ph[k].total / GiB:.1f}" for k in ("rollout", "log_prob", "update")),
            f"{kv_cache_room(facts, p, w) / GiB:.1f}",
            *([f"{host / GiB:.1f}"] if host is not None else []),
            fits,
        )
    return t


def terms_table(
    phases: dict[str, PhasePeak],
    point: Point,
    plain: bool = False,
    *,
    title: str | None = None,
    total: str = "peak",
) -> Table:
    """Every term of ``phases``, each phase closed by its ``total`` row (the peak of a memory phase)."""
    t = Table(title=title or f"memory terms at {describe(point, plain)}")
    for col in ("phase", "term", "GiB", "formula"):
        t.add_column(col, justify="right" if col == "GiB" else "left")
    for phase in phases.values():
        for term in phase.terms:
            name = f"{term.name} [{term.stage}]" if term.stage else term.name
            t.add_row(phase.phase, name, f"{term.bytes / GiB:.2f}", term.formula)
        note = (
            "always + largest stage" + (", ≥ optimizer step" if phase.floor else "")
            if phase.stage_bytes()
            else ""
        )
        t.add_row(phase.phase, f"[b]{total}[/b]", f"[b]{phase.total / GiB:.2f}[/b]", note, end_section=True)
    return t


def checkpoint_table(options: list[tuple[str, PhasePeak]], free_bytes: int, where: object) -> Table:
    """One checkpoint's size per setting (:func:`klppo.tune.disk.settings`): weights, optimizer state, the
    rest (tensor records, files), the total and whether it fits ``free_bytes`` (free under ``where``)."""
    t = Table(title=f"one checkpoint per setting (GiB; {free_bytes / GiB:.1f} GiB free under {where})")
    for col in ("setting", "weights", "optimizer state", "records, files", "total", "fits"):
        t.add_column(col, justify="left" if col == "setting" else "right")
    for keys, size in options:
        weights = sum(x.bytes for x in size.terms if x.name.endswith(" weights"))
        state = sum(x.bytes for x in size.terms if x.name.endswith(" optimizer state"))
        rest = size.total - weights - state
        t.add_row(
            keys,
            *(f"{v / GiB:.2f}" for v in (weights, state, rest, size.total)),
            "yes" if size.total <= free_bytes else "no",
        )
    return t


def comm_table(units, point: Point, link_gbps: float, tflops: float) -> Table:
    """Per unit, one micro-batch: bytes all-gathered / reduce-scattered, communication vs compute time,
    and whether prefetching it behind its neighbour's compute hides it (assumed link and matmul rates)."""
    exposed = sum(u.exposed_s for u in units)
    total = sum(u.compute_s for u in units) + exposed
    table = Table(
        title=f"communication per micro-batch at {describe(point)} (assumed {link_gbps:.0f} GB/s, "
        f"{tflops:.0f} TFLOP/s): exposed {1e3 * exposed:.2f} ms = {100 * exposed / max(total, 1e-12):.0f}% "
        "of the pass"
    )
    for name in ("unit", "params", "all-gather MB", "reduce-scatter MB", "comm ms", "compute ms", "hidden"):
        table.add_column(name, justify="right")
    for u in units:
        table.add_row(
            "root" if u.index == len(units) - 1 else str(u.index),
            f"{u.params:,}",
            f"{u.all_gather_bytes / 1e6:.1f}",
            f"{u.reduce_scatter_bytes / 1e6:.1f}",
            f"{1e3 * u.comm_s:.3f}",
            f"{1e3 * u.compute_s:.3f}",
            _yn(u.hidden),
        )
    return table


def overrides(p: Point, plain: bool = False) -> list[str]:
    """verl keys that select ``p`` for the actor (use_dynamic_bsz so the token budget applies); ``plain``
    (the plain path runs ``p``): no FSDP2 knob (units, prefetch, resharding), offload_policy off (which the
    plain path needs) and the offload between phases, which moves both copies there."""
    fsdp2 = [
        f"{FSDP_KEY}.wrap_policy.min_num_params={p.min_num_params}",
        f"{FSDP_KEY}.forward_prefetch={_tf(p.forward_prefetch)}",
        f"{FSDP_KEY}.reshard_after_forward={_tf(p.reshard_after_forward)}",
    ]
    return [
        *([] if plain else fsdp2[:1]),
        f"{FSDP_KEY}.param_offload={_tf(p.offload == 'idle')}",
        f"{FSDP_KEY}.optimizer_offload={_tf(p.offload == 'idle')}",
        f"{FSDP_KEY}.offload_policy={_tf(p.offload == 'cpu')}",
        *([] if plain else fsdp2[1:]),
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={p.micro_tokens}",
    ]


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points (x, y) not dominated (no other point has x' ≤ x and y' ≤ y, one strictly)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((a <= x and b <= y) and (a < x or b < y) for j, (a, b) in enumerate(points) if j != i):
            front.append(i)
    return front


def plot(ranked, num_micro: int, path: Path, device_bytes: float, headroom: float) -> Path:
    """Scatter of memory vs time per 1k tokens, Pareto front joined, best point ringed; needs matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415  optional extra (klppo[plot])

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415  optional extra (klppo[plot])
    except ImportError as e:
        raise RuntimeError(
            "the plot needs matplotlib: pip install 'klppo[plot]' (or pip install matplotlib)"
        ) from e
    ok = [(m, need, fit) for m, need, fit in ranked if m.status == "ok"]
    xy = [(1e6 * m.step_s / (num_micro * m.point.micro_tokens), need / GiB) for m, need, _ in ok]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"off": "tab:blue", "idle": "tab:orange", "cpu": "tab:green"}
    for (m, _, fit), (x, y) in zip(ok, xy):
        ax.scatter(x, y, c=colors[m.point.offload], marker="o" if fit else "x", s=30)
    front = sorted((xy[i] for i in pareto(xy)), key=lambda p: p[0])
    if front:
        ax.plot(*zip(*front), "k--", lw=1, label="Pareto front")
    pick = best(ranked, num_micro)
    if pick is not None:
        i = next(i for i, (m, _, _) in enumerate(ok) if m is pick)
        ax.scatter(*xy[i], s=180, facecolors="none", edgecolors="red", label="pick")
    ax.axhline(headroom * device_bytes / GiB, color="grey", lw=0.8, label=f"{headroom:.0%} of device")
    for mode in sorted({m.point.offload for m, _, _ in ok}):
        ax.scatter([], [], c=colors[mode], label=f"offload={mode}")
    ax.set_xscale("log")
    ax.set_xlabel("actor update time per 1k tokens (ms)")
    ax.set_ylabel("peak memory per rank (GiB)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _threshold(n: int) -> str:
    return "whole" if n >= WHOLE_MODEL else f"{n:.0e}" if n else "0"


def _yn(b: bool) -> str:
    return "y" if b else "n"


def _tf(b: bool) -> str:
    return "true" if b else "false"


def _f(x: float, digits: int) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.{digits}f}"
