"""Predicted peak host memory of one rank (bytes), term by term, and the check that a setting fits the
device and the host before any weight loads.

Terms (``P`` trained parameters, ``Ps`` the rank's shard, ``m`` master bytes, ``c`` compute bytes,
``V·h`` the largest parameter — the embedding or LM head):

- the process itself, :data:`PROCESS_BYTES` (Python, torch, the CUDA context's host side, transformers):
  a constant, not fitted;
- ``offload="cpu_step"`` (:mod:`klppo.parallel.cpu_optim`): the masters ``P·m`` and AdamW ``2·P·4`` for the
  whole run, and the step's pinned buffers ``2·U·(m + c)`` (two chunks of gradients in the master dtype and
  two of values in the compute dtype; ``U`` the largest chunk:
  :data:`~klppo.parallel.cpu_optim.STEP_CHUNK_BYTES` of masters or the largest parameter); with LoRA none
  of these (the plain path keeps no masters of frozen weights; the adapters' are not counted);
- ``offload="idle"`` (``param_offload`` + ``optimizer_offload``): what sits on the host while the role is
  idle — the shard ``Ps·m`` (plain path: the masters, none of frozen weights with LoRA, and the compute
  copy ``P·c``) and AdamW ``2·Ps·4``;
- ``offload="cpu"`` (FSDP2 ``offload_policy``): the shards, their gradients and AdamW, ``Ps·(2m + 8)``;
- a reference kept on the host between its passes (``Workload.reference_offloaded``): ``P·c``;
- a critic that offloads (``TuneWorkload.critic``, :mod:`klppo.tune.critic`): the terms above for its own
  mode, of the value model's parameters on its own model (``critic.model.path``) in its own dtypes; with
  LoRA (``critic.model.lora_rank``) no AdamW of the frozen weights.

Not modelled: the model's load (transformers reads the checkpoint through the host once, before the
optimizer exists), data loaders and the rollout's host buffers (small beside these terms).
"""

from __future__ import annotations

import dataclasses
import math
import os

from klppo.parallel.cpu_optim import STEP_CHUNK_BYTES
from klppo.tune.critic import CriticWorkload, run_peaks
from klppo.tune.memory import OFFLOAD_MODES, PhasePeak, Point, TuneWorkload, Workload
from klppo.tune.units import ModelFacts

PROCESS_BYTES = 6 * 2**30
"""Host memory of a trainer process before any model state: interpreter, torch with CUDA, transformers."""


def host_peak(
    facts: ModelFacts, point: Point, w: Workload, *, critic: CriticWorkload | None = None
) -> PhasePeak:
    """The host's peak for one rank at ``point`` (module docstring): the actor's terms, the reference's and,
    with a ``critic`` that offloads, the critic's (its own model, dtypes and LoRA)."""
    phase = PhasePeak("host")
    phase.add("process", PROCESS_BYTES, "torch, CUDA context, libraries")
    plain = w.runs_plain(point)
    _role_terms(phase, "", facts.num_params, point.offload, w, plain=plain, facts=facts, adamw=not w.lora)
    if w.reference_offloaded:
        phase.add("offloaded reference", facts.num_params * w.compute_bytes, "P·c")
    if critic is not None and critic.point.offload != "off":
        cw, cfacts = critic.workload, critic.facts(facts)
        plain = cw.runs_plain(critic.point)
        _role_terms(
            phase,
            "critic ",
            cfacts.num_params,
            critic.point.offload,
            cw,
            plain=plain,
            facts=cfacts,
            adamw=not cw.lora,
        )
    return phase


def _role_terms(
    phase: PhasePeak,
    label: str,
    P: int,
    offload: str,
    w: Workload,
    *,
    plain: bool,
    facts: ModelFacts,
    adamw: bool,
) -> None:
    """One trained role's host terms under ``offload`` (module docstring), its names prefixed by ``label``;
    ``adamw`` False: no optimizer state of ``P`` (LoRA: the adapters' is small and not counted); on the
    plain path with LoRA no masters of ``P`` either (frozen weights are their own masters)."""
    m, c, k = w.master_bytes, w.compute_bytes, 8 if adamw else 0
    shard = math.ceil(P / w.shard_ranks)
    masters = 0 if plain and w.lora else shard * m
    if offload == "cpu_step":
        largest = max(STEP_CHUNK_BYTES // m, facts.shape.vocab * facts.shape.hidden)
        phase.add(f"{label}masters", masters, "P·m (LoRA: 0)")
        phase.add(f"{label}optimizer (AdamW)", P * k, "2·P·4")
        buffers = 2 * largest * (m + c) if masters else 0  # LoRA: the adapters' chunks, not counted
        phase.add(f"{label}step buffers (pinned)", buffers, "2·U·(m+c) (LoRA: 0)")
    elif offload == "idle":
        phase.add(f"{label}offloaded shards", masters, "ceil(P/f)·m (between phases; plain LoRA: 0)")
        if plain:
            phase.add(f"{label}offloaded compute copy", P * c, "P·c (plain path, between phases)")
        phase.add(f"{label}offloaded AdamW", shard * k, "2·ceil(P/f)·4 (between updates)")
    elif offload == "cpu":
        phase.add(
            f"{label}shards, grads, AdamW",
            shard * (m + (m if adamw else 0) + k),
            "ceil(P/f)·(2m+8) (offload_policy)",
        )


def host_text(phase: PhasePeak, host_bytes: int) -> str:
    """``phase``'s total against ``host_bytes``, with its terms (GiB)."""
    terms = ", ".join(f"{t.name} {t.bytes / 2**30:.1f}" for t in phase.terms if t.bytes)
    return f"{phase.total / 2**30:.1f} GiB of {host_bytes / 2**30:.0f} ({terms})"


def host_ram_bytes(processes: int | None = None) -> int:
    """This machine's physical memory (bytes), shared by the ``processes`` training on it (None: those
    torchrun starts, ``LOCAL_WORLD_SIZE``): one process's share."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // (processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def fit(workload: TuneWorkload, model_config: object, *, host_bytes: int) -> tuple[dict[str, float], float]:
    """(device peak per phase, host peak), in bytes, at the configured point (the critic's with the actor's:
    :func:`klppo.tune.critic.run_peaks`, :func:`host_peak`)."""
    facts = ModelFacts.from_config(model_config)
    host = host_peak(facts, workload.update_point, workload.workload, critic=workload.critic)
    return run_peaks(workload, facts), host.total


def alternatives(workload: TuneWorkload, model_config: object, *, host_bytes: int) -> list[str]:
    """The settings, among the offload modes the run can take and gradient checkpointing on, predicted to
    fit both the device and ``host_bytes``: one phrase each with its two figures, smallest device peak
    first."""
    facts, w = ModelFacts.from_config(model_config), workload.workload
    found = []
    for offload in OFFLOAD_MODES:
        if offload == "cpu_step" and not w.plain:
            continue  # one process only
        for ckpt in (w.grad_checkpointing, True):
            wl = dataclasses.replace(w, grad_checkpointing=ckpt)
            tw = dataclasses.replace(
                workload, workload=wl, point=dataclasses.replace(workload.point, offload=offload)
            )
            device = max(run_peaks(tw, facts).values())
            host = host_peak(facts, tw.update_point, wl, critic=workload.critic).total
            if device <= w.device_bytes and host <= host_bytes:
                keys = OFFLOAD_KEYS[offload] + (", enable_gradient_checkpointing=true" if ckpt else "")
                found.append(
                    (device, f"{keys} (device {device / 2**30:.1f} GiB, host {host / 2**30:.1f} GiB)")
                )
    return [text for _, text in sorted(set(found))]


OFFLOAD_KEYS = {
    "off": "no offload",
    "idle": "param_offload=true, optimizer_offload=true",
    "cpu": "offload_policy=true",
    "cpu_step": "optimizer_step_on_cpu=true",
}
"""The ``fsdp_config`` keys of each offload mode, for messages."""


REFUSE_SHARE = 1.15
"""A run is refused when a device phase is predicted above this multiple of the device (the model's stated
error, ~15%, above the device: it cannot fit) or the host above its memory; between 0.95 and this the
pre-flight warns (:func:`klppo.tune.preflight.check_memory`)."""


def refusal(workload: TuneWorkload, model_config: object, *, host_bytes: int) -> str | None:
    """The sentence that refuses the run when its predicted device peak exceeds :data:`REFUSE_SHARE` × the
    device or its host peak exceeds ``host_bytes``, naming the figure and what would fit
    (:func:`alternatives`); None when it fits."""
    phases, host = fit(workload, model_config, host_bytes=host_bytes)
    device = workload.workload.device_bytes
    worst = max(phases, key=phases.get)
    over = []
    if phases[worst] > REFUSE_SHARE * device:
        over.append(
            f"the {worst} phase is predicted to need {phases[worst] / 2**30:.1f} GiB of the GPU's "
            f"{device / 2**30:.0f} GiB"
        )
    if host > host_bytes:
        facts = ModelFacts.from_config(model_config)
        terms = host_peak(facts, workload.update_point, workload.workload, critic=workload.critic).terms
        critic_bytes = sum(t.bytes for t in terms if t.name.startswith("critic "))
        over.append(
            f"the host is predicted to need {host / 2**30:.1f} GiB of its {host_bytes / 2**30:.0f} GiB"
            + (
                f" ({critic_bytes / 2**30:.1f} GiB of it the critic's: a smaller critic, "
                "critic.model.path, or critic.model.lora_rank would hold less)"
                if critic_bytes
                else ""
            )
        )
    if not over:
        return None
    fits = alternatives(workload, model_config, host_bytes=host_bytes)
    advice = (
        "predicted to fit (actor_rollout_ref.actor.fsdp_config / actor_rollout_ref.model): " + "; ".join(fits)
        if fits
        else "no offload mode fits: use LoRA (actor_rollout_ref.model.lora_rank), more GPUs, or "
        "smaller micro-batches (ppo_max_token_len_per_gpu)"
    )
    return f"{' and '.join(over)}: {advice}; `klppo tune <same arguments> --dry-run` shows every term"
