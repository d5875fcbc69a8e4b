"""OOMRecovery on its own: halving rules, retry limit, events and checkpoint state (no model: FSDP reset of a
plain module is a no-op)."""

from __future__ import annotations

import pytest
import torch

from klppo.roles.forward import MicroBatching
from klppo.roles.oom import OOMRecovery, halved


def failing(times: int):
    seen: list[MicroBatching] = []

    def attempt(micro: MicroBatching) -> int:
        seen.append(micro)
        if len(seen) <= times:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB")
        return micro.micro_batch_size

    return attempt, seen


def test_halves_until_it_fits_and_keeps_the_smaller_size():
    rec, model = OOMRecovery("actor"), torch.nn.Linear(2, 2)
    rec.max_retries = 3
    attempt, seen = failing(2)
    assert rec.run("log_prob", MicroBatching(micro_batch_size=8), attempt, model) == 2
    assert [m.micro_batch_size for m in seen] == [8, 4, 2]
    assert [(e["micro_batch_size_old"], e["micro_batch_size_new"]) for e in rec.events] == [(8, 4), (4, 2)]
    # the next call starts from the halved size; the state survives a checkpoint
    again = OOMRecovery("actor")
    again.load_state_dict(rec.state_dict())
    assert again.run("log_prob", MicroBatching(micro_batch_size=8), lambda m: m.micro_batch_size, model) == 2
    assert again.run("update", MicroBatching(micro_batch_size=8), lambda m: m.micro_batch_size, model) == 8


def test_token_budget_halved_with_dynamic_bsz_and_limits():
    assert halved(MicroBatching(micro_batch_size=4, use_dynamic_bsz=True, max_token_len=1000)) == (
        "max_token_len",
        1000,
        500,
    )
    assert halved(MicroBatching(micro_batch_size=1)) is None
    rec, model = OOMRecovery("critic"), torch.nn.Linear(2, 2)
    rec.max_retries = 1
    with pytest.raises(torch.OutOfMemoryError):  # 2 failures, 1 retry allowed
        rec.run("values", MicroBatching(micro_batch_size=8), failing(2)[0], model)
    rec.max_retries = 5
    with pytest.raises(torch.OutOfMemoryError):  # nothing left to halve at 1
        rec.run("values", MicroBatching(micro_batch_size=2), failing(9)[0], model)
    off = OOMRecovery("ref")  # max_retries 0 (monitor off): the error passes through at once
    with pytest.raises(torch.OutOfMemoryError):
        off.run("log_prob", MicroBatching(micro_batch_size=8), failing(1)[0], model)
    assert off.events == []
