"""``reward_model.launch_reward_fn_async``: the responses decoded and scored in a spawned worker process
while the step goes on — the same scores and texts as scoring in the step, the function's own errors
raised at the reward phase, signal-based timeouts working (the worker's main thread runs them), and a
training run whose every metric equals the in-step run's (tests/trainer/test_reward_async_run.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from klppo.batch import Batch
from klppo.models.tiny import build_tiny_tokenizer
from klppo.roles.reward import Reward

SCORE_BY_TEXT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (sum(map(ord, solution_str)) % 7) / 6.0 + extra_info["row"]
"""
# scores by text and row; raises a ValueError, an exception class of its own, or one that does not unpickle
SCORE_OR_RAISE = """
class VerifierError(Exception):
    pass

class TwoArgError(Exception):  # does not unpickle: its __init__ takes two arguments
    def __init__(self, row, why):
        super().__init__(f"row {row}: {why}")

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str == "RAISE":
        raise ValueError(f"cannot score row {extra_info['row']}")
    if solution_str == "own":
        raise VerifierError("cannot parse")
    if solution_str == "two":
        raise TwoArgError(3, "cannot parse")
    return (sum(map(ord, solution_str)) % 7) / 6.0 + extra_info["row"]
"""
WHERE_AND_ALARM = """
import os, signal
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    signal.signal(signal.SIGALRM, lambda *a: None)  # ValueError outside a main thread
    signal.alarm(30)
    signal.alarm(0)
    return float(os.getpid())
"""


def _batch(tok, texts: list[str]) -> Batch:
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    width = max(1, max(len(r) for r in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r, dtype=torch.long), 1.0
    n = len(rows)
    return Batch(
        prompts=torch.zeros(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.long),
        responses=ids,
        response_mask=mask,
        data_source=["x"] * n,
        ground_truth=["1"] * n,
        extra_info=[{"row": i} for i in range(n)],
    )


def _reward(tmp_path: Path, source: str, *, background: bool) -> Reward:
    path = tmp_path / f"fn_{abs(hash(source))}.py"
    path.write_text(source)
    return Reward(build_tiny_tokenizer(), custom_fn_path=str(path), background=background)


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    """One background reward of 3 workers shared by the tests that leave it working (spawning costs
    seconds)."""
    path = tmp_path_factory.mktemp("fn") / "score_or_raise.py"
    path.write_text(SCORE_OR_RAISE)
    reward = Reward(build_tiny_tokenizer(), custom_fn_path=str(path), background=True, num_workers=3)
    yield reward, Reward(build_tiny_tokenizer(), custom_fn_path=str(path))
    reward.close()


@pytest.mark.xdist_group("reward_background")
def test_every_worker_starts_with_the_reward(background):
    """A spawn pool starts its processes on demand; the reward asks for all of them at once, so that their
    imports overlap the trainer's set-up instead of step 1's reward phase."""
    reward, _ = background
    processes = reward.worker._processes()
    assert len(processes) == 3
    [f.result(timeout=60) for f in reward.worker.pids]
    assert all(_alive(p.pid) for p in processes)


@pytest.mark.xdist_group("reward_background")
def test_background_scores_equal_the_in_step_scores_in_row_order_over_the_workers(background):
    from klppo.roles.reward_worker import slices

    assert slices(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert slices(2, 4) == [(0, 1), (1, 2)]  # no empty slice
    assert slices(0, 4) == [(0, 0)]  # an empty batch still gets its (empty) result
    reward, sync = background
    tok = build_tiny_tokenizer()
    batch = _batch(tok, ["12 + 30 = 42", "", "the answer is 7", "9", "x", "yy", "zzz"])
    assert sync.submit(batch) is None  # scores in the step
    pending = reward.submit(batch)
    assert len(pending._futures) == 3  # three slices, one per worker
    want, got = sync.score(batch), pending.result()
    assert got.texts == want.texts and got.texts[0] != ""
    torch.testing.assert_close(got.sequence, want.sequence, rtol=0, atol=0)  # extra_info["row"]: the order
    torch.testing.assert_close(got.token_level, want.token_level, rtol=0, atol=0)
    assert want.sequence[3] >= 3  # the row's own extra_info reached the function


@pytest.mark.xdist_group("reward_background")
def test_the_functions_exceptions_reach_the_reward_phase_and_the_workers_survive_them(background):
    from klppo.rewards.registry import RewardFunctionError

    reward, _ = background
    tok = build_tiny_tokenizer()
    with pytest.raises(
        RewardFunctionError, match=r"compute_score, row 1 raised ValueError: cannot score row 1"
    ):
        reward.submit(_batch(tok, ["fine", "RAISE"])).result()
    with pytest.raises(
        RewardFunctionError, match="raised VerifierError: cannot parse"
    ):  # the user's own class
        reward.submit(_batch(tok, ["own"])).result()
    with pytest.raises(RewardFunctionError, match="raised TwoArgError: row 3: cannot parse") as two:
        reward.submit(_batch(tok, ["two"])).result()
    assert "\n" not in str(two.value)  # one line, whether the exception pickles or not
    fine = reward.submit(_batch(tok, ["fine"])).result().sequence  # and the workers still score
    assert fine.tolist() == pytest.approx([(sum(map(ord, "fine")) % 7) / 6.0])
    assert reward.worker.alive


def test_a_closed_reward_scores_in_the_step(tmp_path):
    tok = build_tiny_tokenizer()
    reward = _reward(tmp_path, SCORE_BY_TEXT, background=True)
    reward.close()
    assert reward.submit(_batch(tok, ["a"])) is None


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped — by a container's init that reaps nothing — is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    try:
        return "\tZ" not in next(
            line for line in status.read_text().splitlines() if line.startswith("State:")
        )
    except (OSError, StopIteration):
        return True


def test_the_worker_ignores_sigint_and_sigterm_and_a_killed_worker_leaves_scoring_to_the_step(
    tmp_path, caplog
):
    """A Ctrl-C or a scheduler's SIGTERM to the process group must not take the scorer down in the step the
    trainer finishes before saving; a worker that dies all the same (killed here) costs no step: its pending
    scores are computed in the step, and so are the next steps', with one warning."""
    import signal
    import time

    tok = build_tiny_tokenizer()
    batch = _batch(tok, ["a", "b", "c"])
    reward = _reward(tmp_path, WHERE_AND_ALARM, background=True)
    try:
        pid = reward.worker.pids[0].result(timeout=60)
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        assert pid != os.getpid()  # a separate process, where signal.alarm worked (its main thread)
        assert set(reward.submit(batch).result().sequence.tolist()) == {float(pid)}  # still the worker
        pending = reward.submit(batch)
        os.kill(pid, signal.SIGKILL)
        with caplog.at_level("WARNING", logger="klppo"):
            scores = pending.result()  # computed in the step (or by the worker, had it finished first)
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            later = reward.submit(batch)
            if later is not None:  # the pool may learn of the death only at this call's result
                later.result()
            assert reward.submit(batch) is None  # from now on: in the step
        assert set(scores.sequence.tolist()) <= {float(pid), float(os.getpid())}
        assert reward.score(batch).sequence.tolist() == [float(os.getpid())] * 3
        warned = [r.getMessage() for r in caplog.records if "scoring process stopped" in r.getMessage()]
        assert len(warned) == 1
        # the exit code where the process could be waited for (not where SIGCHLD is ignored, as under xdist)
        assert "exit code -9: killed" in warned[0] or "terminated abruptly" in warned[0]
    finally:
        reward.close()


SLOW_OR_STUCK = """
import re, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str == "sleep":
        time.sleep(120)
    if solution_str == "regex":  # catastrophic backtracking: minutes in C, the GIL held throughout
        re.fullmatch(r"(a+)+$", "a" * 64 + "b")
    return 0.0
"""


def test_close_does_not_wait_for_a_batch_still_being_scored(tmp_path):
    """After a failed or interrupted step a batch may still be in a worker (a hung verifier): the end of the
    run kills the workers instead of waiting for it."""
    import time

    tok = build_tiny_tokenizer()
    reward = _reward(tmp_path, SLOW_OR_STUCK, background=True)
    pid = reward.worker.pids[0].result(timeout=60)
    reward.submit(_batch(tok, ["sleep"]))
    time.sleep(0.5)
    start = time.monotonic()
    reward.close()
    assert time.monotonic() - start < 10 and not _alive(pid)


ORPHAN_BUSY = """
import os, sys, time
from klppo.models.tiny import build_tiny_tokenizer
from klppo.roles.reward import Reward
from tests.roles.test_reward_async import _batch
tok = build_tiny_tokenizer()
reward = Reward(tok, custom_fn_path=sys.argv[1], background=True)
print(reward.worker.pids[0].result(timeout=60), flush=True)
reward.submit(_batch(tok, ["regex"]))
time.sleep(1.0)  # the worker is inside the regex now, holding its GIL
os._exit(0)
"""


def test_a_trainer_that_dies_while_its_worker_holds_the_gil_leaves_no_scoring_process(tmp_path):
    import subprocess
    import sys
    import time

    fn = tmp_path / "fn.py"
    fn.write_text(SLOW_OR_STUCK)
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", ORPHAN_BUSY, str(fn)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, 9)
        pytest.fail("the scoring process outlived its trainer")


STOPS_ITS_CHILD = """
import subprocess, sys
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.terminate()  # a verifier stopping its sandbox on a timeout
    try:
        return float(child.wait(timeout=20))
    except subprocess.TimeoutExpired:
        child.kill()
        raise RuntimeError("the child ignored SIGTERM")
"""


def test_processes_the_function_starts_are_stopped_by_sigterm(tmp_path):
    """The worker shrugs off SIGINT/SIGTERM with a handler, not SIG_IGN, which a process it starts would
    inherit: the function's own subprocess dies on terminate() as in the step."""
    import signal

    tok = build_tiny_tokenizer()
    reward = _reward(tmp_path, STOPS_ITS_CHILD, background=True)
    try:
        got = reward.submit(_batch(tok, ["a"])).result().sequence.tolist()
    finally:
        reward.close()
    assert got == [-float(signal.SIGTERM)] == reward.score(_batch(tok, ["a"])).sequence.tolist()


def length_scorer(solution_str, ground_truth, **kwargs):  # module level: sent to the workers by reference
    return float(len(solution_str)) * kwargs.get("scale", 1.0)


def test_scorers_registered_in_the_trainer_score_in_the_workers(monkeypatch):
    """``register_scorer`` in the trainer's process reaches the scoring processes (with reward_kwargs that
    only it accepts); one that cannot be sent (a lambda) is refused at once, naming the key."""
    from klppo.rewards import registry

    monkeypatch.setitem(registry.SCORERS, "mine", length_scorer)
    tok = build_tiny_tokenizer()
    batch = _batch(tok, ["abc", "de"]).replace(data_source=["mine", "mine"])
    reward = Reward(tok, background=True, reward_kwargs={"scale": 2.0})
    try:
        got = reward.submit(batch).result().sequence.tolist()
    finally:
        reward.close()
    assert got == Reward(tok, reward_kwargs={"scale": 2.0}).score(batch).sequence.tolist()
    assert got[0] > 0
    monkeypatch.setitem(registry.SCORERS, "lambda", lambda s, g, **k: 1.0)
    with pytest.raises(
        ValueError, match=r"launch_reward_fn_async=True: the scorer registered for data_source 'lambda'"
    ):
        Reward(tok, background=True)


RANDOM_SCORE = """
import random, torch
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return torch.rand(()).item() + random.random()
"""


def test_a_random_reward_function_scores_the_same_for_the_same_seed(tmp_path):
    """The workers' generators are seeded per batch and slice (the step's sampling seed): a repeated or
    resumed run scores alike, a different step differently."""
    tok = build_tiny_tokenizer()
    batch = _batch(tok, ["a", "b", "c"])
    path = tmp_path / "rnd.py"
    path.write_text(RANDOM_SCORE)
    reward = Reward(tok, custom_fn_path=str(path), background=True, num_workers=2)
    try:  # the same seed after other draws in the same processes: seeded per batch, not once per process
        run = [reward.submit(batch, seed=s).result().sequence.tolist() for s in (5, 9, 5)]
    finally:
        reward.close()
    assert run[0] == run[2] != run[1]
    assert run[0][0] != run[0][2]  # the second slice has its own seed


STOPS_ITS_FORKED_CHILD = """
import multiprocessing, time
def _work(ready):
    ready.set()
    time.sleep(60)
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_work, args=(ready,))
    child.start()
    ready.wait(20)  # running its own code (a signal before the fork hooks ran would meet the parent's)
    child.terminate()  # a verifier stopping a forked worker on a timeout
    child.join(timeout=20)
    alive = child.is_alive()
    if alive:
        child.kill()
    return float(alive)
"""


def test_processes_the_function_forks_are_stopped_by_sigterm(tmp_path):
    """A forked child inherits Python's signal handlers: the worker resets them to the defaults in it."""
    tok = build_tiny_tokenizer()
    reward = _reward(tmp_path, STOPS_ITS_FORKED_CHILD, background=True)
    try:
        got = reward.submit(_batch(tok, ["a"])).result().sequence.tolist()
    finally:
        reward.close()
    assert got == [0.0] == reward.score(_batch(tok, ["a"])).sequence.tolist()  # the child died


def test_slice_seeds_do_not_meet_across_ranks_steps_or_slices():
    """Neighbouring ranks' sampling seeds differ by 1: slice seeds are hashed, not seed + slice."""
    from klppo.roles.reward_worker import slice_seed
    from klppo.trainer.phases import sample_seed

    seeds = [
        slice_seed(sample_seed(1, step) + rank, i)
        for step in range(20)
        for rank in range(4)
        for i in range(4)
    ]
    assert len(set(seeds)) == len(seeds)
    assert slice_seed(7, 1) == slice_seed(7, 1) and all(0 <= s < 2**64 for s in seeds)


NONE_AT_ROW_3 = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return None if extra_info["row"] == 3 else 1.0
"""


def test_an_error_names_the_batchs_row_whichever_slice_it_is_in(tmp_path):
    tok = build_tiny_tokenizer()
    path = tmp_path / "none3.py"
    path.write_text(NONE_AT_ROW_3)
    batch = _batch(tok, ["a", "b", "c", "d", "e"])
    reward = Reward(tok, custom_fn_path=str(path), background=True, num_workers=2)  # slices [0, 3), [3, 5)
    try:
        with pytest.raises(ValueError, match=r", row 3, returned None"):
            reward.submit(batch).result()
    finally:
        reward.close()
    with pytest.raises(ValueError, match=r", row 3, returned None"):
        Reward(tok, custom_fn_path=str(path)).score(batch)


def test_a_scorer_that_does_not_load_in_the_worker_leaves_scoring_to_the_step(monkeypatch, caplog):
    """A registered scorer pickles in the trainer but its module is not importable in the spawned process
    (as one defined under ``if __name__ == "__main__":``): the first batch scores in the step, and the
    warning names the error."""
    import sys
    import types

    from klppo.rewards import registry

    module = types.ModuleType("klppo_test_only_in_this_process")
    module.length_scorer = types.FunctionType(length_scorer.__code__, {}, "length_scorer")
    module.length_scorer.__module__ = module.__name__
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(registry.SCORERS, "here-only", module.length_scorer)
    tok = build_tiny_tokenizer()
    batch = _batch(tok, ["abc", "de"]).replace(data_source=["here-only"] * 2)
    reward = Reward(tok, background=True)
    try:
        with caplog.at_level("WARNING", logger="klppo"):
            got = reward.submit(batch).result().sequence.tolist()
        assert got == [3.0, 2.0]  # scored in the step
        assert reward.submit(batch) is None  # and from now on
    finally:
        reward.close()
    warned = [r.getMessage() for r in caplog.records if "could not start" in r.getMessage()]
    assert len(warned) == 1 and "klppo_test_only_in_this_process" in warned[0]


DELEGATES = """
from klppo.rewards import get_scorer
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return get_scorer(data_source)(solution_str, ground_truth)
"""


def test_a_custom_function_may_hand_rows_to_registered_scorers(tmp_path, monkeypatch):
    """With custom_reward_function the registered scorers still reach the workers (the function may call
    get_scorer); one that cannot be pickled is then left out instead of refused."""
    from klppo.rewards import registry

    monkeypatch.setitem(registry.SCORERS, "mine", length_scorer)
    monkeypatch.setitem(registry.SCORERS, "lambda", lambda s, g, **k: 1.0)
    tok = build_tiny_tokenizer()
    batch = _batch(tok, ["abc", "de"]).replace(data_source=["mine", "mine"])
    reward = _reward(tmp_path, DELEGATES, background=True)
    try:
        assert reward.submit(batch).result().sequence.tolist() == [3.0, 2.0]
    finally:
        reward.close()
