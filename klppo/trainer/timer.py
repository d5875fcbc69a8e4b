"""Phase timing for ``timing_s/<phase>`` metrics, and the out-of-memory report that names the phase and
what to change.

On CUDA a phase's time is its span on the device's timeline: a CUDA event is recorded on the current
stream at each edge, and :meth:`PhaseTimer.metrics` reads them once, after one synchronisation. Nothing
synchronises at the edges, so the host prepares the next phase (packing, planning, launches) while the
device still runs the previous one; the events still time each phase from the moment the device reaches
its start to the moment it finishes its last kernel, the device's idle time inside the phase (waiting for
the host) included. A phase of host work only (scoring, planning) counts the time it keeps the device
waiting: from the later of its start and the end of the device's earlier work, to its end. The phases
still sum to at most the step (``timing_s/step``, itself a phase around them all).
Off CUDA the host's clock times each phase (the host is the device)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from klppo.parallel.dist import phase as dist_phase

# what to change when a phase runs out of device memory (verl key names)
_OOM_ADVICE = {
    "gen": "lower actor_rollout_ref.rollout.gpu_memory_utilization (KV cache budget) or rollout.n, keep "
    "rollout.free_cache_engine=True, or set actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "gen_max": "as for generation: lower actor_rollout_ref.rollout.gpu_memory_utilization",
    "old_log_prob": "lower actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu (or "
    "log_prob_max_token_len_per_gpu with log_prob_use_dynamic_bsz=True); keep model.use_remove_padding=True",
    "ref": "lower actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu, or set "
    "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "values": "lower critic.forward_micro_batch_size_per_gpu (or critic.forward_max_token_len_per_gpu)",
    "update_actor": "lower actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu "
    "(or ppo_max_token_len_per_gpu with use_dynamic_bsz=True), set "
    "actor_rollout_ref.model.enable_gradient_checkpointing=True, or "
    "fsdp_config.param_offload/optimizer_offload=True",
    "reward": "lower reward_model.micro_batch_size_per_gpu (or "
    "reward_model.forward_max_token_len_per_gpu with "
    "reward_model.use_dynamic_bsz=True)",
    "update_critic": "lower critic.ppo_micro_batch_size_per_gpu (or critic.ppo_max_token_len_per_gpu), set "
    "critic.model.enable_gradient_checkpointing=True or critic.model.fsdp_config.optimizer_offload=True",
}


class PhaseOutOfMemory(RuntimeError):
    """Device memory ran out in a named phase of the step; the message says what to change."""


class PhaseTimer:
    """``timing_s/<phase>`` of one step (module docstring): device events on CUDA, the host's clock off it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_device = device.type == "cuda"  # CUDA events, else the host's clock
        self.seconds: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def _event(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextmanager
    def phase(self, name: str):
        if self.on_device:
            first = self._event()
        else:
            start = time.perf_counter()
        try:
            with dist_phase(name), _ranges(name, self.device):
                yield
        except torch.OutOfMemoryError as exc:
            raise PhaseOutOfMemory(out_of_memory_message(name, self.device)) from exc
        if self.on_device:
            self._events.append((name, first, self._event()))
            return
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """Every phase so far, in seconds (waits for the device's events of the phases not yet read)."""
        for name, first, last in self._events:
            last.synchronize()
            self.seconds[name] = self.seconds.get(name, 0.0) + first.elapsed_time(last) / 1e3
        self._events.clear()
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}


@contextmanager
def _ranges(name: str, device: torch.device):
    """The phase as a torch.profiler range (traces of ``global_profiler.tool=torch``) and, on GPU, an NVTX
    range (nsys)."""
    with torch.profiler.record_function(f"phase/{name}"):
        if device.type != "cuda":
            yield
            return
        torch.cuda.nvtx.range_push(f"phase/{name}")
        try:
            yield
        finally:
            torch.cuda.nvtx.range_pop()


def out_of_memory_message(phase: str, device: torch.device) -> str:
    used = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        used = f" (peak allocated {peak:.1f} of {total:.1f} GiB)"
    advice = _OOM_ADVICE.get(phase, "lower the micro-batch sizes or enable offload")
    return (
        f"out of device memory in phase {phase!r}{used}. To fit: {advice}. `klppo tune` predicts the memory "
        "of each setting. The step did not complete and no checkpoint was written for it: the last "
        "checkpoint is intact, and the same command resumes from it after the change."
    )
