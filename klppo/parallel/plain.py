"""The one-GPU path without FSDP2: a role trained by one process keeps its model's parameters in the compute
dtype and the master weights beside them — FSDP2's numerics on a one-rank mesh, without its per-unit
copy-in/cast/copy-out, hooks and DTensor dispatch (``fsdp_config.plain_single_gpu``; bench/PENDING.md,
issue 18).

What FSDP2 does on one rank with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``, and what is done here
instead (tests/parallel/test_plain.py requires the two to agree bit for bit on CPU):

- forward: FSDP2 casts each master shard to ``param_dtype`` (``Tensor.to``: round to nearest even) into its
  unsharded parameter before every forward. Here the model's parameters *are* that copy, refreshed once
  per optimizer step (:meth:`MasterWeights.copy_to_model`: one foreach copy, the same rounding).
- backward: FSDP2 copies each unsharded gradient into a ``reduce_dtype`` buffer, casts it to the master
  dtype and adds it to the sharded gradient (assigns it on the first micro-batch), then drops the
  unsharded gradient. :meth:`MasterWeights.accumulate_grads` does that arithmetic after each micro-batch's
  backward (one foreach add) and drops the compute-dtype gradients.
- clip and optimizer step: on the masters (the optimizer is built over them), the norm in the arithmetic of
  FSDP2's DTensor path (:func:`klppo.parallel.local_shards.norm_of_shards`).
- checkpoints: :attr:`MasterWeights.module` holds the masters under the model's parameter names (and the
  model's persistent buffers), so DCP's state dicts are the FSDP2 model's: a checkpoint moves between
  this path and FSDP2 on any world size. Loading into it refreshes the compute copy.

Memory: one master (the model's dtype, fp32) and one compute copy (bf16) of every parameter, the fp32
master gradients, and the bf16 gradients of one backward; no all-gather buffers.
Leaves out: several processes (sharding is what FSDP2 is for), FSDP2's ``offload_policy`` (parameters on
the host during compute). Knows nothing about roles or the config: it takes :class:`FSDPSettings`.
"""

from __future__ import annotations

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


class MasterWeights:
    """The masters of a model trained on one process without FSDP2 (built by :func:`plain_model`).

    ``model``'s parameters are in the compute dtype (``param_dtype``); ``masters[i]`` is the master of
    ``params[i]`` (``model.parameters()``, a tied weight once), a leaf ``nn.Parameter`` in the model's loaded
    dtype with the same ``requires_grad``. The optimizer, the clip and the checkpoint work on ``module``."""

    def __init__(
        self, model: nn.Module, *, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype
    ) -> None:
        self.model = model
        self.reduce_dtype = reduce_dtype
        self.params = list(model.parameters())
        with torch.no_grad():
            self.masters = [
                nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in self.params
            ]
        cast_params(model, param_dtype)
        self.module = _mirror(model, {id(p): m for p, m in zip(self.params, self.masters)})
        # DCP's set_state_dict ends in module.load_state_dict: the loaded masters reach the compute copy
        self.module.register_load_state_dict_post_hook(
            lambda module, keys: self.copy_to_model(trained_only=False)
        )
        self._trained = [(p, m) for p, m in zip(self.params, self.masters) if p.requires_grad]

    @torch.no_grad()
    def accumulate_grads(self) -> None:
        """Add the compute-dtype gradients of the last backward into the master gradients, as FSDP2's
        one-rank reduce does (cast to ``reduce_dtype``, then to the master dtype; assigned when the master
        has none yet, else one foreach add), and drop them (the next backward starts from none)."""
        into, grads = [], []
        for p, m in self._trained:
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
        grads = [m.grad for m in self.masters if m.grad is not None]
        if not grads:
            return torch.zeros(())
        total = norm_of_shards(grads, [])
        clip_local_shards_(grads, max_norm, total)
        return total

    @torch.no_grad()
    def copy_to_model(self, *, trained_only: bool = True) -> None:
        """The masters into the compute-dtype parameters (one foreach copy, round to nearest even); only the
        trained ones after an optimizer step, all after a checkpoint load."""
        pairs = self._trained if trained_only else list(zip(self.params, self.masters))
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])

    def parameters(self):
        """The compute parameters and the masters (what an offload moves; see :meth:`to`)."""
        yield from self.params
        yield from self.masters

    def to(self, device: torch.device) -> MasterWeights:
        """Both copies (and their gradients, the optimizer state aside) to ``device``: what
        :class:`klppo.parallel.offload.OffloadSchedule` calls for ``param_offload``; the mirror's buffers
        follow the model's."""
        self.model.to(device)
        with torch.no_grad():
            for m in self.masters:
                m.data = m.data.to(device)
                if m.grad is not None:
                    m.grad = m.grad.to(device)
        self.module = _relink_buffers(self.module, self.model)
        return self


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
    return MasterWeights(model, param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype)
