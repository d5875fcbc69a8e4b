"""The report's figures: which metrics each shows, and drawing them with matplotlib.

A figure is a grid of panels, one metric per panel (x: training step), with one line per run in the run's
colour and a legend naming the runs, so several runs overlay without ambiguity. The monitor's events
(``events.jsonl``) are dotted vertical lines in the run's colour on every panel, their kinds written on
the first. Non-finite values leave a gap in the line and a red ``x`` on the step axis. A panel whose metric
no run logged is left out; a figure with no panel is not drawn (the page lists it as not logged).

matplotlib is optional (``pip install 'klppo[plot]'``); `require_matplotlib` says so in one line. Drawing
uses ``matplotlib.figure.Figure`` with the Agg canvas (no pyplot, no display, no global state).
"""

from __future__ import annotations

import fnmatch
import io
import math
from dataclasses import dataclass
from pathlib import Path

from klppo.report.runs import RunData


@dataclass(frozen=True)
class FigureSpec:
    """One figure: ``slug`` names its PNG, ``patterns`` the metric keys it shows (``fnmatch`` patterns,
    in panel order; a key matched twice is shown once); the keys matching ``breakdown`` (not already a
    panel) share one last panel of horizontal bars, their mean over the steps, one bar per run."""

    slug: str
    title: str
    caption: str
    patterns: tuple[str, ...]
    breakdown: str | None = None


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec(
        "score",
        "Score and reward",
        "Mean sequence score (reward function) and reward (score − KL "
        "penalty when the KL is in the reward) of the step's samples, with the batch's best and worst.",
        ("critic/score/mean", "critic/rewards/mean", "critic/score/max", "critic/score/min"),
    ),
    FigureSpec(
        "kl",
        "KL to the reference",
        "k1 (log-ratio) and k3 (low-variance) estimates of KL(policy ‖ reference) per response token, the "
        "KL loss and the KL penalty in the reward, their "
        "coefficients, and the approximate KL of the PPO update (actor/ppo_kl).",
        (
            "actor/ref_kl_k1",
            "actor/ref_kl_k3",
            "actor/kl_loss",
            "actor/reward_kl_penalty",
            "actor/kl_coef",
            "actor/kl_loss_ctrl_kl",
            "actor/reward_kl_penalty_coeff",
            "actor/reward_kl_penalty_share",
            "actor/ppo_kl",
        ),
    ),
    FigureSpec(
        "entropy",
        "Entropy",
        "Mean per-token entropy of the policy on its own samples (nats).",
        ("actor/entropy",),
    ),
    FigureSpec(
        "response_length",
        "Response length",
        "Response tokens per sample and the share of responses cut at data.max_response_length.",
        ("response_length/mean", "response_length/max", "response_length/clip_ratio"),
    ),
    FigureSpec(
        "advantages",
        "Advantages, returns and values",
        "Over the step's response tokens.",
        (
            "critic/advantages/mean",
            "critic/advantages/max",
            "critic/advantages/min",
            "critic/returns/mean",
            "critic/values/mean",
            "critic/vf_explained_var",
        ),
    ),
    FigureSpec(
        "update",
        "Policy and value updates",
        "Losses, clipped fraction and gradient norms of the updates.",
        (
            "actor/pg_loss",
            "actor/pg_clipfrac",
            "actor/grad_norm",
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/grad_norm",
        ),
    ),
    FigureSpec(
        "rollout_correction",
        "Rollout correction",
        "The mismatch between the trainer's policy and the one that sampled (the rollout engine's, or a "
        "log's): KL estimates and the absolute log-perplexity gap per token, and, with "
        "algorithm.rollout_correction, the importance weights' mean, maximum and effective sample share, "
        "the share of weights cut at the threshold, and the share of tokens rejection sampling left out.",
        (
            "rollout/log_prob_diff",
            "rollout_corr/kl",
            "rollout_corr/k3_kl",
            "rollout_corr/log_ppl_abs_diff",
            "rollout_corr/rollout_is_mean",
            "rollout_corr/rollout_is_max",
            "rollout_corr/rollout_is_eff_sample_size",
            "rollout_corr/rollout_is_ratio_fraction_high",
            "rollout_corr/rollout_rs_masked_fraction",
        ),
    ),
    FigureSpec(
        "timing",
        "Time per phase",
        "Seconds per step: the whole step, the rollout, and the mean of "
        "every phase (timing_s/*) over the run's steps.",
        ("timing_s/step", "timing_s/gen"),
        breakdown="timing_s/*",
    ),
    FigureSpec(
        "throughput",
        "Throughput",
        "Tokens per second per device over the whole step, rollout "
        "generation speed, and the model-FLOPs utilization of the actor update.",
        ("perf/throughput", "rollout/tokens_per_s", "perf/mfu/actor"),
    ),
    FigureSpec(
        "memory",
        "Memory",
        "Peak GPU memory of the fullest rank per step (allocated, reserved), the "
        "rollout's KV cache, and the peak resident host memory of the fullest process.",
        (
            "perf/max_memory_allocated_gb",
            "perf/max_memory_reserved_gb",
            "perf/rollout_peak_memory_gb",
            "rollout/kv_cache_gb",
            "perf/max_rss_gb",
        ),
    ),
    FigureSpec(
        "validation",
        "Validation",
        "Held-out score per data source (logged before training at "
        "step 0 with trainer.val_before_train, then every trainer.test_freq steps and at the end).",
        ("val-core/*", "val-aux/*", "val/*"),
    ),
    FigureSpec("monitor", "Monitor", "The run monitor's metrics.", ("monitor/*",)),
)

# one colour per run (matplotlib's default cycle, fixed here so a run keeps its colour in every figure)
COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


def require_matplotlib() -> None:
    """Raise ImportError with the one-line install hint when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401, PLC0415  optional extra (klppo[plot])
    except ImportError:
        raise ImportError(
            "the run report draws with matplotlib, which is not installed: pip install 'klppo[plot]'"
        ) from None


def panel_keys(spec: FigureSpec, runs: list[RunData]) -> list[str]:
    """The metric keys of ``spec`` that at least one run logged, in the order of its patterns."""
    logged = sorted({k for run in runs for k in run.keys()})
    keys: list[str] = []
    for pattern in spec.patterns:
        for key in logged if any(c in pattern for c in "*?[") else [pattern]:
            if fnmatch.fnmatchcase(key, pattern) and key in logged and key not in keys:
                keys.append(key)
    return keys


def breakdown_keys(spec: FigureSpec, runs: list[RunData]) -> list[str]:
    """The keys of the breakdown panel (see `FigureSpec`), largest mean first over all runs."""
    if spec.breakdown is None:
        return []
    panels = set(panel_keys(spec, runs))
    logged = {k for run in runs for k in run.keys() if fnmatch.fnmatchcase(k, spec.breakdown)} - panels
    return sorted(logged, key=lambda k: (-max(_mean_over_steps(run, k) for run in runs), k))


def _mean_over_steps(run: RunData, key: str) -> float:
    finite = [v for v in run.series(key)[1] if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else 0.0


@dataclass
class DrawnFigure:
    spec: FigureSpec
    keys: list[str]
    png: bytes


def make_figure(spec: FigureSpec, runs: list[RunData], *, dpi: int = 100):
    """The matplotlib ``Figure`` of ``spec`` (Agg canvas), or None when no run logged any of its metrics."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415  optional extra (klppo[plot])
    from matplotlib.figure import Figure  # noqa: PLC0415  optional extra (klppo[plot])

    keys = panel_keys(spec, runs)
    bars = breakdown_keys(spec, runs)
    num_panels = len(keys) + bool(bars)
    if not num_panels:
        return None
    ncols = min(3, num_panels)
    nrows = math.ceil(num_panels / ncols)
    height = 3.1 * nrows + 0.6
    fig = Figure(figsize=(4.6 * ncols, height), dpi=dpi)
    FigureCanvasAgg(fig)
    # fixed margins in inches (matplotlib's constrained layout doubled the drawing time)
    fig.subplots_adjust(
        left=0.75 / (4.6 * ncols),
        right=1 - 0.15 / (4.6 * ncols),
        top=1 - 0.75 / height,
        bottom=0.5 / height,
        wspace=0.28,
        hspace=0.55,
    )
    fig.suptitle(spec.title, fontsize=13, fontweight="bold")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for i, (ax, key) in enumerate(zip(axes, keys)):
        _draw_panel(ax, key, runs, label_events=i == 0)
        if i == 0 and (len(runs) > 1 or any(run.events for run in runs)):
            ax.legend(fontsize=8, loc="best")
    if bars:
        _draw_breakdown(axes[len(keys)], spec, bars, runs)
    for ax in axes[num_panels:]:
        ax.set_visible(False)
    return fig


def _draw_breakdown(ax, spec: FigureSpec, keys: list[str], runs: list[RunData]) -> None:
    """Horizontal bars: each key's mean over the steps, one bar per run (largest key on top)."""
    height = 0.8 / len(runs)
    for index, run in enumerate(runs):
        positions = [len(keys) - 1 - k + 0.4 - height * (index + 0.5) for k in range(len(keys))]
        ax.barh(
            positions,
            [_mean_over_steps(run, k) for k in keys],
            height=height,
            color=COLORS[index % len(COLORS)],
            label=run.name,
        )
    ax.set_yticks(range(len(keys)), [k.split("/", 1)[-1] for k in reversed(keys)], fontsize=8)
    ax.set_title(f"{spec.breakdown} (mean per step)", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(True, axis="x", alpha=0.3)


def draw_figure(spec: FigureSpec, runs: list[RunData], *, dpi: int = 100) -> DrawnFigure | None:
    """The figure as PNG bytes, or None when no run logged any of its metrics."""
    fig = make_figure(spec, runs, dpi=dpi)
    if fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    keys = panel_keys(spec, runs) + breakdown_keys(spec, runs)
    return DrawnFigure(spec=spec, keys=keys, png=buffer.getvalue())


def _draw_panel(ax, key: str, runs: list[RunData], *, label_events: bool) -> None:
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415  optional extra (klppo[plot])

    ax.set_title(key, fontsize=10)
    ax.set_xlabel("step", fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    for index, run in enumerate(runs):
        color = COLORS[index % len(COLORS)]
        steps, values = run.series(key)
        finite = [v if math.isfinite(v) else math.nan for v in values]
        marker = "o" if len(steps) <= 30 else None
        ax.plot(steps, finite, color=color, marker=marker, markersize=3, linewidth=1.4, label=run.name)
        bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
        if bad:
            ax.plot(
                bad,
                [0.0] * len(bad),
                "x",
                color="red",
                markersize=7,
                clip_on=False,
                transform=ax.get_xaxis_transform(),
                label=None,
            )
        for event in run.events:
            ax.axvline(event.step, color=color, linestyle=":", linewidth=1.2, alpha=0.8)
            if label_events:
                ax.text(
                    event.step,
                    0.98,
                    f" {event.kind}",
                    transform=ax.get_xaxis_transform(),
                    rotation=90,
                    va="top",
                    ha="left",
                    fontsize=7,
                    color=color,
                )
    if label_events and any(run.events for run in runs):
        ax.plot([], [], color="grey", linestyle=":", label="monitor event")


def draw_all(runs: list[RunData], *, dpi: int = 100) -> tuple[list[DrawnFigure], list[FigureSpec]]:
    """(drawn figures, figures no run logged), in `FIGURES` order."""
    require_matplotlib()
    drawn, missing = [], []
    for spec in FIGURES:
        figure = draw_figure(spec, runs, dpi=dpi)
        if figure is None:
            missing.append(spec)
        else:
            drawn.append(figure)
    return drawn, missing


def write_pngs(figures: list[DrawnFigure], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for figure in figures:
        path = out_dir / f"{figure.spec.slug}.png"
        path.write_bytes(figure.png)
        paths.append(path)
    return paths
