"""The training ranks as one named ``DeviceMesh`` ``("dp", "sp")``: data-parallel groups of Ulysses
sequence-parallel ranks.

Rank ``r`` sits at ``dp = r // sp_size``, ``sp = r % sp_size``: the ``sp_size`` consecutive ranks of a
sequence-parallel group see the same samples and split each packed row along its tokens; data-parallel
shares of a batch go to the ``dp`` groups. FSDP2 shards over the flattened ``dp × sp`` ranks (all of them,
in rank order, as verl does): :func:`klppo.parallel.fsdp.build_mesh` keeps the 1-D world mesh, which is
that flattening. With ``sp_size == 1`` the ``sp`` group is a single rank and everything reduces to plain
data parallelism.

The rollout has its own mesh of the same ranks, ``("dp", "tp")`` (:func:`build_rollout_mesh`): groups of
``tensor_model_parallel_size`` consecutive ranks generate together on tensor-parallel slices of the
weights (:mod:`klppo.parallel.reshard`, :mod:`klppo.rollout.tp`), data parallel across the groups.
Knows nothing about models or PPO.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's Ulysses group: ``size`` ranks sharing samples, this one at position ``rank``."""

    group: dist.ProcessGroup
    size: int
    rank: int


@dataclass(frozen=True)
class ParallelMesh:
    """The ``("dp", "sp")`` mesh of all ranks and this rank's coordinates in it."""

    mesh: DeviceMesh | None
    dp_size: int
    dp_rank: int
    sp_size: int
    sp_rank: int

    @property
    def sequence_parallel(self) -> SequenceParallel | None:
        """This rank's sequence-parallel group; None when ``sp_size == 1`` (no all-to-all at all)."""
        if self.sp_size == 1 or self.mesh is None:
            return None
        return SequenceParallel(self.mesh.get_group("sp"), self.sp_size, self.sp_rank)


def build_parallel_mesh(sp_size: int, device_type: str) -> ParallelMesh:
    """The ``(world // sp_size, sp_size)`` mesh named ``("dp", "sp")`` over all ranks (collective on
    first call); a single process without a group gets a mesh-less ``ParallelMesh`` of size 1."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if sp_size < 1 or world % sp_size:
        raise ValueError(f"ulysses_sequence_parallel_size={sp_size} must divide the world size {world}")
    if not dist.is_initialized():
        return ParallelMesh(None, 1, 0, 1, 0)
    mesh = init_device_mesh(device_type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    r = dist.get_rank()
    return ParallelMesh(mesh, world // sp_size, r // sp_size, sp_size, r % sp_size)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's rollout tensor-parallel group: ``size`` consecutive ranks splitting each layer's heads,
    MLP and vocabulary, this one at position ``rank``; ``ranks`` are the group's global ranks in order."""

    group: dist.ProcessGroup
    size: int
    rank: int
    ranks: tuple[int, ...]


def build_rollout_mesh(tp_size: int, device_type: str) -> TensorParallel | None:
    """The rollout's ``(world // tp_size, tp_size)`` mesh named ``("dp", "tp")`` over all ranks and this
    rank's tensor-parallel group (collective); None when ``tp_size == 1`` (each rank generates alone).

    Rank ``r`` sits at ``dp = r // tp_size``, ``tp = r % tp_size``, as in the training mesh: the ranks of
    a group are consecutive, so on one host they share the fastest links.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp_size < 1 or world % tp_size:
        raise ValueError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp_size} must divide the world size "
            f"{world}"
        )
    if tp_size == 1:
        return None
    mesh = init_device_mesh(device_type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    r = dist.get_rank()
    first = r - r % tp_size
    return TensorParallel(mesh.get_group("tp"), tp_size, r % tp_size, tuple(range(first, first + tp_size)))
