"""The optimizer step on the CPU for the plain path (``fsdp_config.optimizer_step_on_cpu``): the fp32
masters and the Adam/AdamW state stay in host memory for the whole run; the device holds the compute copy
and the master gradients only.

Contract of :meth:`HostStep.step` (after the clip, which runs on the device gradients): the trained masters
are cut into chunks of whole parameters, consecutive in the flat buffers (:data:`STEP_CHUNK_BYTES` of master
dtype, or one larger parameter). For chunk ``k``:

1. its master gradients are copied device → pinned host buffer ``k mod 2`` (enqueued on the device's
   stream, ``non_blocking``; an event marks the end), chunk ``k + 1``'s copy enqueued before chunk ``k`` is
   stepped, so the PCIe copy of the next chunk runs under the CPU's step of this one;
2. the host waits for its event, points the chunk's masters' ``.grad`` at the host buffer and runs torch's
   own ``step`` over the chunk's parameters only (the param groups narrowed for the call: same state,
   same hyperparameters, the scheduler's lr), then drops those ``.grad``;
3. the updated masters are cast on the CPU into pinned compute-dtype buffer ``k mod 2`` (round to nearest
   even, as the device's cast) and copied host → device into the compute copy (``non_blocking``, its event
   recorded); buffer ``k mod 2`` is reused two chunks later, after that event.

Safe because each chunk's parameters are stepped once with their own gradients (AdamW is elementwise per
parameter: a narrowed step equals the whole step on those parameters), and every copy into a buffer waits
for the last reader of that buffer. The step ends when the last copy into the compute copy completes.

Numerics: torch's Adam/AdamW on CPU tensors (``foreach``) over the same fp32 masters, gradients and state as
the device step — equal to it within float rounding of the implementations (tests/parallel/test_cpu_optim.py:
within 1e-6 of the on-device path over 3 steps on CPU). The state dict is torch's (keyed by the masters),
so checkpoints move between this path and the others.

Leaves out: FSDP2 (its ``offload_policy`` is the sharded equivalent), optimizers other than Adam/AdamW,
splitting a parameter larger than a chunk (the embedding and LM head are one chunk each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from klppo.parallel.plain import MasterWeights

STEP_CHUNK_BYTES = 256 * 2**20
"""Master bytes stepped per chunk: large enough that torch's foreach step outlasts its Python overhead,
small enough that the next chunk's copy hides under it."""


@dataclass(eq=False)
class _Chunk:
    """Consecutive trained parameters: the host masters, their gradients' device storage (read at step time
    from the holders), the masters' host storage and the compute copy on the device, all of ``numel``."""

    masters: list[nn.Parameter]
    holders: list[nn.Parameter]
    master: torch.Tensor
    compute: torch.Tensor
    numel: int


def _chunks(ms: MasterWeights, limit_bytes: int) -> list[_Chunk]:
    """The trained parameters of ``ms`` in chunks of at most ``limit_bytes`` of masters (a larger parameter
    alone), flat buffers by offsets, parameters with storage of their own one by one."""
    out = []
    for f in ms._flats:
        limit, i = max(1, limit_bytes // f.master.element_size()), 0
        for j in range(1, len(f.params) + 1):
            if j == len(f.params) or f.offsets[j + 1] - f.offsets[i] > limit:
                lo, hi = f.offsets[i], f.offsets[j]
                out.append(
                    _Chunk(f.masters[i:j], f.grad_params[i:j], f.master[lo:hi], f.compute[lo:hi], hi - lo)
                )
                i = j
    for (p, m), (_, h) in zip(ms._loose, ms._loose_grads, strict=True):
        out.append(_Chunk([m], [h], m.data.view(-1), p.data.view(-1), p.numel()))
    return out


class _Buffers:
    """Two pinned host buffers per kind (gradients in the master dtype, values in the compute dtype), each
    with the event of the copy that last used it."""

    def __init__(self, chunks: list[_Chunk], device: torch.device) -> None:
        size = max(c.numel for c in chunks)
        pin = device.type == "cuda"
        first = chunks[0]

        def pair(dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.empty(size, dtype=dtype, pin_memory=pin) for _ in range(2)]

        self.grads, self.values = pair(first.master.dtype), pair(first.compute.dtype)
        self.device = device
        self.grad_events: list[object | None] = [None, None]
        self.value_events: list[object | None] = [None, None]

    def event(self) -> object | None:
        if self.device.type != "cuda":
            return None  # CPU copies are done when they return
        event = torch.cuda.Event()
        event.record()
        return event


def _wait(event: object | None) -> None:
    if event is not None:
        event.synchronize()


class HostStep:
    """Mixin for torch's Adam/AdamW over host masters (:func:`host_step_class`): ``step`` streams the
    gradients from the device chunk by chunk (module docstring); ``zero_grad`` drops the device gradients.
    ``attach`` it to its :class:`MasterWeights` once, after construction."""

    _ms: MasterWeights | None = None

    def attach(self, ms: MasterWeights, *, chunk_bytes: int | None = None) -> None:
        """Step ``ms``'s trained masters in chunks of ``chunk_bytes`` (None: :data:`STEP_CHUNK_BYTES`)."""
        if not ms.host_masters:
            raise ValueError("HostStep needs MasterWeights with host_masters=True")
        self._ms = ms
        self._chunk_list = _chunks(ms, chunk_bytes or STEP_CHUNK_BYTES)
        self._device = ms.params[0].device
        self._buffers: _Buffers | None = None  # allocated at the first step

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._ms is not None:
            self._ms.drop_master_grads()

    @torch.no_grad()
    def step(self, closure=None):
        """Streamed over the chunks when the device holds master gradients; torch's step as it is otherwise
        (gradients set on the host masters themselves: DCP's state initialisation before a load)."""
        chunks = [c for c in getattr(self, "_chunk_list", ()) if c.holders[0].grad is not None]
        if closure is not None or not chunks:
            return super().step(closure)
        if self._buffers is None:
            self._buffers = _Buffers(self._chunk_list, self._device)
        buf = self._buffers
        self._fetch(chunks[0], 0)
        for k, chunk in enumerate(chunks):
            if k + 1 < len(chunks):
                self._fetch(chunks[k + 1], (k + 1) % 2)
            _wait(buf.grad_events[k % 2])
            grads = buf.grads[k % 2][: chunk.numel].split([m.numel() for m in chunk.masters])
            for m, g in zip(chunk.masters, grads, strict=True):
                m.grad = g.view(m.shape)
            self._step_only(chunk.masters)
            for m in chunk.masters:
                m.grad = None
            _wait(buf.value_events[k % 2])  # the buffer's previous copy to the device has read it
            values = buf.values[k % 2][: chunk.numel]
            values.copy_(chunk.master)
            chunk.compute.copy_(values, non_blocking=True)
            buf.value_events[k % 2] = buf.event()
        for event in buf.value_events:
            _wait(event)
        return None

    def _fetch(self, chunk: _Chunk, slot: int) -> None:
        """Enqueue the device → host copy of ``chunk``'s gradients into gradient buffer ``slot``."""
        buf = self._buffers
        _wait(buf.grad_events[slot])
        into = buf.grads[slot]
        offset = 0
        for h in chunk.holders:
            n = h.numel()
            into[offset : offset + n].copy_(h.grad.reshape(-1), non_blocking=True)
            offset += n
        buf.grad_events[slot] = buf.event()

    def _step_only(self, params: list[nn.Parameter]) -> None:
        """torch's ``step`` over ``params`` only: each group narrowed to them for the call."""
        keep = {id(p) for p in params}
        saved = [group["params"] for group in self.param_groups]
        try:
            for group in self.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in keep]
            super().step()
        finally:
            for group, params_of in zip(self.param_groups, saved, strict=True):
                group["params"] = params_of


class HostAdamW(HostStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` over host masters, its step streamed (:class:`HostStep`)."""


class HostAdam(HostStep, torch.optim.Adam):
    """``torch.optim.Adam`` over host masters, its step streamed (:class:`HostStep`)."""


_HOST_CLASSES: dict[type, type] = {torch.optim.AdamW: HostAdamW, torch.optim.Adam: HostAdam}


def host_step_class(cls: type) -> type:
    """The host-step variant of torch's Adam or AdamW; a ValueError for any other class."""
    try:
        return _HOST_CLASSES[cls]
    except KeyError:
        raise ValueError(
            f"optimizer_step_on_cpu steps torch.optim Adam or AdamW, not {cls.__module__}.{cls.__name__}"
        ) from None
