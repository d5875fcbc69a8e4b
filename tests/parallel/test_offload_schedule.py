"""OffloadSchedule: which parts move when, for nested blocks; a role never added raises."""

from __future__ import annotations

import pytest
import torch

from klppo.parallel import offload as O


class Role:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.AdamW(self.model.parameters())


@pytest.fixture
def moves(monkeypatch) -> list[tuple[str, object]]:
    """Record every move the schedule asks for (on CPU the moves themselves are invisible)."""
    log: list[tuple[str, object]] = []
    monkeypatch.setattr(O, "load_params", lambda m, d: log.append(("load_params", m)))
    monkeypatch.setattr(O, "offload_params", lambda m: log.append(("offload_params", m)))
    monkeypatch.setattr(O, "load_optimizer", lambda o, d: log.append(("load_optimizer", o)))
    monkeypatch.setattr(O, "offload_optimizer", lambda o: log.append(("offload_optimizer", o)))
    return log


def test_nested_blocks_move_each_part_once(moves) -> None:
    sched, actor = O.OffloadSchedule(torch.device("cpu")), Role()
    sched.add(
        actor, name="actor", model=actor.model, optimizer=actor.optimizer, params=True, optimizer_state=True
    )
    m, o = actor.model, actor.optimizer
    assert moves == [("offload_params", m), ("offload_optimizer", o)]  # idle parts leave at once
    moves.clear()
    with sched.on_device(actor):
        assert moves == [("load_params", m)]
        with sched.on_device(actor):  # already there: nothing moves
            assert len(moves) == 1
        with sched.on_device(actor, optimizer=True):
            assert moves[1:] == [("load_optimizer", o)]
        assert moves[2:] == [("offload_optimizer", o)]
        assert len(moves) == 3  # parameters stay for the outer block
    assert moves[3:] == [("offload_params", m)]


def test_flags_off_never_move_and_release_survives_errors(moves) -> None:
    sched, critic = O.OffloadSchedule(torch.device("cpu")), Role()
    sched.add(
        critic,
        name="critic",
        model=critic.model,
        optimizer=critic.optimizer,
        params=False,
        optimizer_state=True,
    )
    moves.clear()
    with pytest.raises(RuntimeError, match="boom"), sched.on_device(critic, optimizer=True):
        raise RuntimeError("boom")
    assert moves == [("load_optimizer", critic.optimizer), ("offload_optimizer", critic.optimizer)]
    with sched.on_device(critic):
        pass
    assert len(moves) == 2


def test_unknown_or_inconsistent_roles_raise() -> None:
    sched, actor, stranger = O.OffloadSchedule(torch.device("cpu")), Role(), Role()
    sched.add(actor, name="actor", model=actor.model, params=False, optimizer_state=False)
    with pytest.raises(KeyError, match=r"never added.*\['actor'\]"), sched.on_device(stranger):
        pass
    with pytest.raises(ValueError, match="added twice"):
        sched.add(actor, name="actor", model=actor.model, params=False, optimizer_state=False)
    with pytest.raises(ValueError, match="no optimizer"), sched.on_device(actor, optimizer=True):
        pass
    with pytest.raises(ValueError, match="no optimizer"):
        sched.add(stranger, name="ref", model=stranger.model, params=False, optimizer_state=True)


def test_real_moves_keep_values() -> None:
    """Without the recorder: parameters and AdamW state come back equal (CPU → CPU here, the same calls
    move them to and from the GPU)."""
    role = Role()
    role.model(torch.ones(1, 2)).sum().backward()
    role.optimizer.step()
    before = [p.clone() for p in role.model.parameters()]
    sched = O.OffloadSchedule(torch.device("cpu"))
    sched.add(
        role, name="actor", model=role.model, optimizer=role.optimizer, params=True, optimizer_state=True
    )
    with sched.on_device(role, optimizer=True):
        assert all(torch.equal(a, b) for a, b in zip(before, role.model.parameters()))
        assert set(role.optimizer.state[role.model.weight]) >= {"exp_avg", "exp_avg_sq"}
