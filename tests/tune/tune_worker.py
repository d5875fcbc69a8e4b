"""Rank program for tests/tune/test_dist.py (2 gloo processes, spawned once): rank 0 writes JSON.

Checks in one launch: (1) storage bytes of the rank's sharded params, grads and AdamW state vs the
memory model's terms; (2) bytes passed to all-gather / reduce-scatter during one actor step vs the
communication model, for three points; (3) the profiled step's collective time and exposed part.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from klppo.parallel.dist import destroy, init_distributed
from klppo.tune.comm import step_bytes
from klppo.tune.measure import actor_step, build, measure_point, micro_batch
from klppo.tune.memory import Point, Workload, update_peak
from klppo.tune.shapes import ModelShape, config_from_shape
from klppo.tune.units import WHOLE_MODEL, ModelFacts

TINY = ModelShape("tiny", "qwen2", 64, 2, 4, 2, 128, 256, True, max_position=512)
WORKLOAD = Workload(world_size=2, compute_bytes=4, grad_checkpointing=True)
SEQ, TOKENS, NUM_MICRO = 32, 64, 2


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards; views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def storage_check(config, facts) -> dict:
    point = Point(0, micro_tokens=TOKENS)
    device = torch.device("cpu")
    model, opt = build(config, point, WORKLOAD, device)
    batches = [micro_batch(config, point, WORKLOAD, SEQ, device, seed=i) for i in range(NUM_MICRO)]
    actor_step(model, opt, batches, point, device)  # creates AdamW state
    from klppo.batching.packing import forward_log_probs

    ids, mask, pos, resp = batches[0]
    forward_log_probs(model, ids, mask, pos, response_length=resp, use_remove_padding=True)[
        0
    ].mean().backward()
    params = _storage_bytes(model.parameters())
    grads = _storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
    optim = _storage_bytes(v for s in opt.state.values() for k, v in s.items() if k != "step")
    terms = {t.name: t.bytes for t in update_peak(facts, point, WORKLOAD).terms}
    return {
        "measured": {"params": params, "grads": grads, "optimizer": optim},
        "model": {
            "params": terms["sharded params"],
            "grads": terms["sharded grads"],
            "optimizer": terms["optimizer (AdamW)"],
        },
    }


class Counter:
    """Wraps the c10d collectives FSDP2 calls and sums their bytes (gather: output; scatter: input)."""

    NAMES = {
        "all_gather_single": "ag",
        "all_gather_into_tensor": "ag",
        "reduce_scatter_single": "rs",
        "reduce_scatter_tensor": "rs",
    }

    def __init__(self) -> None:
        self.bytes = {"ag": 0, "rs": 0}
        self.saved = {}

    def __enter__(self):
        for name, kind in self.NAMES.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapped(*args, _fn=fn, _kind=kind, **kwargs):
                key, pos = ("output", 0) if _kind == "ag" else ("input", 1)
                t = kwargs[key] if key in kwargs else args[pos]
                self.bytes[_kind] += t.numel() * t.element_size()
                return _fn(*args, **kwargs)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def comm_check(config, facts) -> dict:
    out = {}
    device = torch.device("cpu")
    for label, point in {
        "per_layer": Point(0, micro_tokens=TOKENS),
        "no_reshard": Point(0, reshard_after_forward=False, micro_tokens=TOKENS),
        "whole": Point(WHOLE_MODEL, micro_tokens=TOKENS),
    }.items():
        model, opt = build(config, point, WORKLOAD, device)
        batches = [micro_batch(config, point, WORKLOAD, SEQ, device, seed=i) for i in range(NUM_MICRO)]
        actor_step(model, opt, batches, point, device)
        with Counter() as c:
            actor_step(model, opt, batches, point, device)
        ag, rs = step_bytes(facts.units(point.min_num_params), point, WORKLOAD, NUM_MICRO)
        out[label] = {"counted": c.bytes, "model": {"ag": ag, "rs": rs}}
    return out


def run(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    init_distributed("cpu", 120)
    config = config_from_shape(TINY)
    facts = ModelFacts.from_config(config)
    result = {"storage": storage_check(config, facts), "comm": comm_check(config, facts)}
    m = measure_point(
        config,
        Point(0, micro_tokens=TOKENS),
        WORKLOAD,
        device=torch.device("cpu"),
        steps=1,
        num_micro=NUM_MICRO,
        seq_len=SEQ,
        profile=True,
    )
    result["profile"] = {"comm_s": m.comm_s, "exposed_s": m.exposed_comm_s, "step_s": m.step_s}
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(result))
    destroy()
