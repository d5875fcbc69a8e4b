"""A tiny entry point for tests/parallel/test_launch.py: 2 gloo ranks, rank 1 raises."""

import sys

import torch.distributed as dist

from klppo.parallel.dist import init_distributed, phase
from klppo.parallel.launch import maybe_relaunch, record_errors


@record_errors
def main(argv: list[str]) -> int:
    code = maybe_relaunch(argv, nproc_per_node=2, nnodes=1, module="relaunch_target", use_gpus=False)
    if code is not None:
        return code
    info = init_distributed("cpu", timeout_s=30)
    with phase("relaunch-test"):
        if info.rank == 1 and argv == ["fail"]:
            raise ValueError("boom from rank 1")
        dist.barrier()
    print(f"rank {info.rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
