"""The one-GPU path without FSDP2: a role trained by one process keeps its model's parameters in the compute
dtype and the master weights beside them — FSDP2's numerics on a one-rank mesh, without its per-unit
copy-in/cast/copy-out, hooks and DTensor dispatch (``fsdp_config.plain_single_gpu``; docs/sharding.md,
"One process: no FSDP2").

What FSDP2 does on one rank with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``, and what is done here
instead (tests/parallel/test_plain.py requires the two to agree bit for bit on CPU):

- forward: FSDP2 casts each master shard to ``param_dtype`` (``Tensor.to``: round to nearest even) into its
  unsharded parameter before every forward. Here the model's parameters *are* that copy, refreshed once
  per optimizer step (:meth:`MasterWeights.copy_to_model`: one copy of a flat buffer, the same rounding).
- backward: FSDP2 copies each unsharded gradient into a ``reduce_dtype`` buffer, casts it to the master
  dtype and adds it to the sharded gradient (assigns it on the first micro-batch), then drops the
  unsharded gradient. :meth:`MasterWeights.accumulate_grads` does that arithmetic after each micro-batch's
  backward (on the gradients concatenated, a chunk of :data:`CHUNK_BYTES` at a time: an add per chunk into
  a flat master gradient) and drops the compute-dtype gradients.
- flat storage: the trained parameters of one kind (device, compute dtype, master dtype) are views into one
  buffer per copy, laid out alike, so the per-step elementwise work is a few kernels whatever the
  number of parameters (a copy or add across dtypes takes no foreach fast path: one kernel per parameter,
  ~1,200 launches per update of Qwen2.5-0.5B). The compute copy keeps its storage (updated in place), as
  CUDA graphs of the update need; a non-contiguous parameter keeps its own storage and the per-tensor ops.
- clip and optimizer step: on the masters (the optimizer is built over them), the norm in the arithmetic of
  FSDP2's DTensor path (:func:`klppo.parallel.local_shards.norm_of_shards`).
- frozen parameters (``requires_grad`` off: a LoRA model's base weights): FSDP2 casts their masters to
  ``param_dtype`` before every forward and never changes them, so the compute copy always equals the masters
  rounded. Here they keep no master: a frozen parameter is its own master, cast once to ``param_dtype``.
- checkpoints: :attr:`MasterWeights.module` holds the masters under the model's parameter names (and the
  model's persistent buffers), so DCP's state dicts are the FSDP2 model's: a checkpoint moves between
  this path and FSDP2 on any world size. Loading into it refreshes the compute copy. Frozen parameters are
  written in the compute dtype (FSDP2 writes them in the master dtype); a load casts what it reads to the
  tensor it loads into, so either one loads into the other with the values each path computes with.

Memory: one master (the model's dtype, fp32) of every trained parameter and one compute copy (bf16) of
every parameter, the fp32 master gradients, and the bf16 gradients of one backward (and, while they are
added, one chunk's concatenation: :data:`CHUNK_BYTES`); no all-gather buffers.
Masters on the host (``host_masters``, ``fsdp_config.optimizer_step_on_cpu``): the trained masters live in
host memory (pinned on CUDA) and the optimizer steps them there (:mod:`klppo.parallel.cpu_optim`); the master
gradients still accumulate on the device, on *gradient holders* (a device parameter of each master's shape
over one element of storage: torch keeps a gradient on its parameter's device), and the step streams them
to the host and the updated values back into the compute copy. Device memory: the compute copy, the master
gradients and one backward's compute-dtype gradients; no masters, no optimizer state.

Leaves out: several processes (sharding is what FSDP2 is for), FSDP2's ``offload_policy`` (parameters on
the host during compute). Knows nothing about roles or the config: it takes :class:`FSDPSettings`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from klppo.parallel.fsdp import FSDPSettings
from klppo.parallel.local_shards import clip_local_shards_, norm_of_shards


def _mirror(model: nn.Module, master_of: dict[int, nn.Parameter]) -> nn.Module:
    """Empty modules with ``model``'s tree (module names, shared modules and tied parameters as there), each
    holding the masters of its module's own parameters and that module's buffers (persistent or not, as
    there): ``state_dict`` and ``named_parameters`` give the model's names with the masters' values."""
    root = nn.Module()
    nodes = {"": root}
    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            parent, _, child = name.rpartition(".")
            nodes[name] = nodes[parent]._modules.get(child) or nn.Module()
            nodes[parent].add_module(child, nodes[name])
        node = nodes[name]
        for key, p in module._parameters.items():
            if p is not None:
                node.register_parameter(key, master_of[id(p)])
        for key, b in module._buffers.items():
            if b is not None:
                node.register_buffer(key, b, persistent=key not in module._non_persistent_buffers_set)
    return root


CHUNK_BYTES = 64 * 2**20
"""The gradients added to the flat master gradient per concatenation: bounds the concatenation's memory (a
parameter larger than this is added by itself) while a chunk's kernel still outlasts its launch."""


@dataclass(eq=False)
class _Flat:
    """Trained parameters of one kind (device, compute dtype, master dtype) end to end: each
    parameter's ``.data`` is a view of ``compute`` and its master's of ``master``, at the same offsets."""

    params: list[nn.Parameter]
    masters: list[nn.Parameter]
    compute: torch.Tensor
    master: torch.Tensor
    grad: weakref.ref | None = None
    """The flat master gradient whose views the masters' ``.grad`` are (dies with them: ``zero_grad``)."""
    holders: list[nn.Parameter] | None = None
    """Host masters only: the device parameters whose ``.grad`` hold the master gradients (else the
    masters)."""

    @property
    def grad_params(self) -> list[nn.Parameter]:
        """Where the master gradients accumulate: the masters, or on the host path their holders."""
        return self.masters if self.holders is None else self.holders

    def __post_init__(self) -> None:
        sizes = [p.numel() for p in self.params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        # consecutive parameters (i, j) of at most CHUNK_BYTES in the compute dtype, or one larger
        self.chunks: list[tuple[int, int]] = []
        limit, i = CHUNK_BYTES // self.compute.element_size(), 0
        for j in range(1, len(sizes) + 1):
            if j == len(sizes) or self.offsets[j + 1] - self.offsets[i] > limit:
                self.chunks.append((i, j))
                i = j

    def master_grad(self) -> torch.Tensor | None:
        """The flat master gradient if every master's ``.grad`` is still its view, else None."""
        flat = None if self.grad is None else self.grad()
        if flat is None or any(m.grad is None or m.grad._base is not flat for m in self.grad_params):
            return None
        return flat


def _point_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``flat`` shaped as ``tensors``, end to end in their order."""
    views = flat.split([t.numel() for t in tensors])
    return [v.view(t.shape) for v, t in zip(views, tensors)]


def _lay_out(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Each of ``params``' ``.data`` made its view of ``flat`` (values as they are there)."""
    for p, v in zip(params, _point_into(params, flat)):
        p.data = v


def _flatten(params: list[nn.Parameter], dtype: torch.dtype) -> torch.Tensor:
    """One buffer of ``dtype`` holding ``params`` end to end (each ``Tensor.to``'s rounding), their storage
    from now on; a parameter's old storage goes as it is copied."""
    flat = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device)
    for p, v in zip(params, _point_into(params, flat)):
        v.copy_(p.data)
        p.data = v
    return flat


class MasterWeights:
    """The masters of a model trained on one process without FSDP2 (built by :func:`plain_model`).

    ``model``'s parameters are in the compute dtype (``param_dtype``); ``masters[i]`` is the master of
    ``params[i]`` (``model.parameters()``, a tied weight once): for a trained parameter a leaf
    ``nn.Parameter`` in the model's loaded dtype, for a frozen one (``requires_grad`` off) ``params[i]``
    itself. The optimizer, the clip and the checkpoint work on ``module``. Both copies of the trained
    parameters live in flat buffers (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype,
        host_masters: bool = False,
    ) -> None:
        """``host_masters``: the masters in host memory, their gradients on holders on the device (module
        docstring); the optimizer over them must stream its step (:mod:`klppo.parallel.cpu_optim`)."""
        self.model = model
        self.reduce_dtype = reduce_dtype
        self.params = list(model.parameters())
        with torch.no_grad():
            self.masters = [
                nn.Parameter(torch.empty(0, dtype=p.dtype, device=p.device)) if p.requires_grad else p
                for p in self.params
            ]
            trained = [(p, m) for p, m in zip(self.params, self.masters) if p is not m]
            for p in self.params if param_dtype is not None else ():
                if not p.requires_grad:  # its own master: cast once (FSDP2's cast, before every forward)
                    p.data = p.data.to(param_dtype)
            self._flats, loose = self._build_flats(trained, param_dtype)
            for p, m in loose:
                m.data = p.detach().clone()
                if param_dtype is not None:
                    p.data = p.data.to(param_dtype)
        self._loose = loose  # trained parameters with storage of their own (not contiguous, or empty)
        self.module = _mirror(model, {id(p): m for p, m in zip(self.params, self.masters)})
        # DCP's set_state_dict ends in module.load_state_dict: the loaded masters reach the compute copy
        self.module.register_load_state_dict_post_hook(lambda module, keys: self._loaded())
        self.host_masters = host_masters
        self._loose_grads = self._loose  # (parameter, where its master gradient accumulates)
        if host_masters:
            self._masters_to_host()

    def _masters_to_host(self) -> None:
        """The masters' storage moved to host memory (pinned with CUDA), holders made for their gradients."""
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self.params)

        def host(t: torch.Tensor) -> torch.Tensor:
            out = t.to("cpu")
            return out.pin_memory() if pin else out

        with torch.no_grad():
            for f in self._flats:
                f.master = host(f.master)
                _lay_out(f.masters, f.master)
                f.holders = [_holder(p, f.master.dtype) for p in f.params]
            for _, m in self._loose:
                m.data = host(m.data)
        self._loose_grads = [(p, _holder(p, m.dtype)) for p, m in self._loose]

    @property
    def grad_params(self) -> list[nn.Parameter]:
        """The parameters whose ``.grad`` are the master gradients: the masters, or their device holders."""
        out = [h for f in self._flats for h in f.grad_params]
        return out + [h for _, h in self._loose_grads] if self.host_masters else self.masters

    def drop_master_grads(self) -> None:
        """Host masters: the master gradients on the holders dropped (the optimizer's ``zero_grad``)."""
        for h in self.grad_params if self.host_masters else ():
            h.grad = None

    def _build_flats(
        self, trained: list[tuple[nn.Parameter, nn.Parameter]], param_dtype: torch.dtype | None
    ) -> tuple[list[_Flat], list[tuple]]:
        """The flat buffers of the ``trained`` (parameter, master) pairs per kind, in their order within
        each, and the pairs left loose: masters first (the parameters' values, the model then pointing into
        them, so that its old storage goes before the compute buffer is allocated: the peak of building is
        the per-tensor one), then the compute copy cast from them."""
        kinds: dict[tuple, list[tuple]] = {}
        loose = []
        for p, m in trained:
            if not p.is_contiguous() or p.numel() == 0:
                loose.append((p, m))
                continue
            kinds.setdefault((p.device, p.dtype, param_dtype or p.dtype), []).append((p, m))
        flats = []
        for (_, master_dtype, compute_dtype), pairs in kinds.items():
            params, masters = [p for p, _ in pairs], [m for _, m in pairs]
            master = _flatten(params, master_dtype)
            for m, v in zip(masters, _point_into(params, master)):
                m.data = v
            compute = _flatten(params, compute_dtype)  # round to nearest even, as FSDP2's cast
            flats.append(_Flat(params, masters, compute, master))
        return flats, loose

    def _loaded(self) -> None:
        """After a load into ``module``: the layout unbroken (the load copied in place), the compute copy
        refreshed (a frozen parameter is its own master: loaded in place)."""
        for f in self._flats:
            ptr, mptr = f.compute.untyped_storage().data_ptr(), f.master.untyped_storage().data_ptr()
            assert all(p.untyped_storage().data_ptr() == ptr for p in f.params), "compute views re-pointed"
            assert all(m.untyped_storage().data_ptr() == mptr for m in f.masters), "masters re-pointed"
        self.copy_to_model(loaded=True)

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the compute-dtype gradients of the last backward into the master gradients, as FSDP2's
        one-rank reduce does (cast to ``reduce_dtype``, then to the master dtype; assigned when the master
        has none yet, else added), and drop them (the next backward starts from none). Per flat buffer, when
        the backward reached all its parameters and their masters' gradients are all none or all its
        views: an add per chunk of concatenated gradients (the same arithmetic element by element); else per
        tensor."""
        rest = list(self._loose_grads)
        for f in self._flats:
            if not self._accumulate_flat(f):
                rest.extend(zip(f.params, f.grad_params))
        self._accumulate_each(rest)

    def _accumulate_flat(self, f: _Flat) -> bool:
        """:meth:`accumulate_grads` of one flat buffer, a chunk of gradients at a time (:data:`CHUNK_BYTES`:
        concatenated, each dropped once in the concatenation); False (nothing done) where it does not
        apply."""
        grads = [p.grad for p in f.params]
        if any(g is None for g in grads):
            return False
        into = f.master_grad()
        fresh = into is None
        if fresh and any(m.grad is not None for m in f.grad_params):
            return False
        for p in f.params:
            p.grad = None
        if fresh:
            into = torch.empty_like(f.master, device=f.compute.device)
        dtype, reduce = into.dtype, self.reduce_dtype
        for i, j in f.chunks:
            g = grads[i].reshape(-1) if j == i + 1 else torch.cat([g.reshape(-1) for g in grads[i:j]])
            grads[i:j] = [None] * (j - i)  # a graph's gradients stay alive in the graph, eager ones go now
            if g.dtype != reduce and dtype != reduce:
                g = g.to(reduce)
            out = into[f.offsets[i] : f.offsets[j]]
            if fresh:  # Tensor.to's cast, into the flat gradient
                out.copy_(g)
            else:  # the cast rule of _accumulate_each
                cast = g.dtype != dtype and g.element_size() >= into.element_size()
                out.add_(g.to(dtype) if cast else g)
        if fresh:
            for m, v in zip(f.grad_params, _point_into(f.masters, into)):
                m.grad = v
            f.grad = weakref.ref(into)
        return True

    def _accumulate_each(self, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
        """:meth:`accumulate_grads` per tensor (one foreach add)."""
        into, grads = [], []
        for p, m in pairs:
            g = own = p.grad
            if g is None:
                continue
            p.grad = None
            if g.dtype != self.reduce_dtype and m.dtype != self.reduce_dtype:
                g = g.to(self.reduce_dtype)
            if m.grad is None:  # never p's own tensor: a CUDA graph's replay writes into it again
                m.grad = g.to(m.dtype, copy=g is own)
            else:
                into.append(m.grad)
                # masters not wider than the gradient (fp32 compute over bf16 masters, fp16 over bf16): FSDP2
                # casts first; a wider master (bf16 into fp32) takes the exact promotion of the foreach add
                cast = g.dtype != m.dtype and g.element_size() >= m.element_size()
                grads.append(g.to(m.dtype) if cast else g)
        if into:
            torch._foreach_add_(into, grads)

    def drop_model_grads(self) -> None:
        """Drop the compute-dtype gradients (what a backward aborted by an out-of-memory error left)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """:func:`klppo.parallel.fsdp.clip_grad_norm_` on the master gradients: their norm before (in FSDP2's
        arithmetic on one rank), each scaled by ``min(1, max_norm / (norm + 1e-6))`` (nan for a nan norm, 0
        for an infinite one)."""
        grads = [m.grad for m in self.grad_params if m.grad is not None]
        if not grads:
            return torch.zeros(())
        total = norm_of_shards(grads, [])
        clip_local_shards_(grads, max_norm, total)
        return total

    @torch.no_grad()
    def copy_to_model(self, *, loaded: bool = False) -> None:
        """The trained masters into their compute-dtype parameters (round to nearest even: one copy per flat
        buffer, one foreach copy of the rest), after an optimizer step or (``loaded``) a checkpoint load.
        With host masters the streamed step has written them already: only a load copies."""
        if self.host_masters and not loaded:
            return
        for f in self._flats:
            f.compute.copy_(f.master)
        if self._loose:
            torch._foreach_copy_([p for p, _ in self._loose], [m for _, m in self._loose])

    def parameters(self):
        """The compute parameters and the trained masters (what an offload moves; see :meth:`to`)."""
        yield from self.params
        yield from (m for p, m in zip(self.params, self.masters) if m is not p)

    def to(self, device: torch.device) -> MasterWeights:
        """Both copies (and their gradients, the optimizer state aside) to ``device``: what
        :class:`klppo.parallel.offload.OffloadSchedule` calls for ``param_offload``; the mirror's buffers
        and frozen parameters follow the model's. A flat buffer moves whole, its views pointed into the
        moved one (the model's ``to`` then leaves them: already there). Not with host masters (they stay on
        the host)."""
        if self.host_masters:
            raise ValueError(
                "masters on the host (optimizer_step_on_cpu) do not move: param_offload is refused"
            )
        with torch.no_grad():
            for f in self._flats:
                grad = f.master_grad()
                f.compute, f.master = f.compute.to(device), f.master.to(device)
                _lay_out(f.params, f.compute)
                _lay_out(f.masters, f.master)
                if grad is not None:  # the master gradients still one buffer's views: moved as one
                    grad = grad.to(device)
                    for m, v in zip(f.masters, _point_into(f.masters, grad)):
                        m.grad = v
                    f.grad = weakref.ref(grad)
                else:
                    _move_grads(f.masters, device)
            for _, m in self._loose:
                m.data = m.data.to(device)
            _move_grads([m for _, m in self._loose], device)
        self.model.to(device)
        self.module = _relink_buffers(self.module, self.model)
        return self


def _holder(p: nn.Parameter, dtype: torch.dtype) -> nn.Parameter:
    """A device parameter of ``p``'s shape and the master's ``dtype`` over one element of storage, whose
    ``.grad`` holds a master gradient (torch keeps a gradient on its parameter's device; the master is on
    the host)."""
    return nn.Parameter(torch.empty((), dtype=dtype, device=p.device).expand(p.shape))


def _move_grads(params: list[nn.Parameter], device: torch.device) -> None:
    for p in params:
        if p.grad is not None:
            p.grad = p.grad.to(device)


def _relink_buffers(mirror: nn.Module, model: nn.Module) -> nn.Module:
    """The mirror's buffers made the model's (again, after the model's ``to`` replaced them)."""
    nodes = dict(mirror.named_modules(remove_duplicate=False))
    for name, module in model.named_modules(remove_duplicate=False):
        for key, b in module._buffers.items():
            if b is not None:
                nodes[name]._buffers[key] = b
    return mirror


def cast_params(model: nn.Module, dtype: torch.dtype | None) -> None:
    """``model``'s parameters (not its buffers: FSDP2 does not cast them) to ``dtype`` in place, each
    ``Tensor.to`` (round to nearest even, as FSDP2's cast); None: as they are. For a model without
    gradients (the reference) this is the whole plain path."""
    if dtype is None:
        return
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)


def plain_model(model: nn.Module, settings: FSDPSettings) -> MasterWeights:
    """The model for one process without FSDP2 (in place): its parameters cast to ``settings.param_dtype``
    (None: kept), their masters in the loaded dtype; buffers as they are (FSDP2 does not cast them)."""
    if settings.offload_policy:
        raise ValueError("the plain path keeps parameters on the device: offload_policy needs FSDP2")
    return MasterWeights(
        model,
        param_dtype=settings.param_dtype,
        reduce_dtype=settings.reduce_dtype,
        host_masters=settings.optimizer_step_on_cpu,
    )
