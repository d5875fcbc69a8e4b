"""The training ranks as one named ``DeviceMesh`` ``("dp", "sp")``: data-parallel groups of Ulysses
sequence-parallel ranks.

Rank ``r`` sits at ``dp = r // sp_size``, ``sp = r % sp_size``: the ``sp_size`` consecutive ranks of a
sequence-parallel group see the same samples and split each packed row along its tokens; data-parallel
shares of a batch go to the ``dp`` groups. FSDP2 shards over the flattened ``dp × sp`` ranks (all of them,
in rank order, as verl does): :func:`klppo.parallel.fsdp.build_mesh` keeps the 1-D world mesh, which is
that flattening. With ``sp_size == 1`` the ``sp`` group is a single rank and everything reduces to plain
data parallelism. Knows nothing about models or PPO.
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
