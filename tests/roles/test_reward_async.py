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
import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str == "RAISE":
        raise ValueError(f"cannot score row {extra_info['row']}")
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
        prompts=torch.zeros(n, 2, dtype=torch.long), prompt_mask=torch.ones(n, 2, dtype=torch.long),
        responses=ids, response_mask=mask, data_source=["x"] * n, ground_truth=["1"] * n,
        extra_info=[{"row": i} for i in range(n)],
    )  # fmt: skip


def _reward(tmp_path: Path, source: str, *, background: bool) -> Reward:
    path = tmp_path / f"fn_{abs(hash(source))}.py"
    path.write_text(source)
    return Reward(build_tiny_tokenizer(), custom_fn_path=str(path), background=background)


def test_background_scores_equal_the_in_step_scores_and_errors_reach_the_reward_phase(tmp_path):
    tok = build_tiny_tokenizer()
    batch = _batch(tok, ["12 + 30 = 42", "", "the answer is 7", "9"])
    sync = _reward(tmp_path, SCORE_BY_TEXT, background=False)
    background = _reward(tmp_path, SCORE_BY_TEXT, background=True)
    try:
        assert sync.submit(batch) is None  # scores in the step
        want, got = sync.score(batch), background.submit(batch).result()
        assert got.texts == want.texts and got.texts[0] != ""
        torch.testing.assert_close(got.sequence, want.sequence, rtol=0, atol=0)
        torch.testing.assert_close(got.token_level, want.token_level, rtol=0, atol=0)
        assert want.sequence[3] >= 3  # the row's own extra_info reached the function
        pending = background.submit(_batch(tok, ["fine", "RAISE"]))
        with pytest.raises(ValueError, match="cannot score row 1"):
            pending.result()
        again = background.submit(batch).result()  # the worker survives a function's error
        torch.testing.assert_close(again.sequence, want.sequence, rtol=0, atol=0)
    finally:
        background.close()
    assert background.submit(batch) is None  # closed: back to scoring in the step


def test_the_worker_is_a_separate_process_where_signal_timeouts_work(tmp_path):
    tok = build_tiny_tokenizer()
    reward = _reward(tmp_path, WHERE_AND_ALARM, background=True)
    try:
        scores = reward.submit(_batch(tok, ["a", "b"])).result()
    finally:
        reward.close()
    pids = set(scores.sequence.tolist())
    assert len(pids) == 1 and pids != {float(os.getpid())}


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
        pid = reward.worker.pid_future.result(timeout=60)
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
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
        warned = [r.message for r in caplog.records if "scoring process stopped" in r.getMessage()]
        assert len(warned) == 1
    finally:
        reward.close()


ORPHAN = """
import os, sys
from klppo.models.tiny import build_tiny_tokenizer
from klppo.roles.reward import Reward
reward = Reward(build_tiny_tokenizer(), custom_fn_path=sys.argv[1], background=True)
print(reward.worker.pid_future.result(timeout=60), flush=True)
os._exit(0)  # no shutdown, no atexit: as if killed
"""


def test_a_trainer_that_dies_outright_leaves_no_scoring_process(tmp_path):
    import subprocess
    import sys
    import time

    fn = tmp_path / "fn.py"
    fn.write_text(SCORE_BY_TEXT)
    out = subprocess.run([sys.executable, "-c", ORPHAN, str(fn)], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def test_several_workers_score_contiguous_slices_in_row_order(tmp_path):
    from klppo.roles.reward_worker import slices

    assert slices(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert slices(2, 4) == [(0, 1), (1, 2)]  # no empty slice
    assert slices(0, 4) == [(0, 0)]  # an empty batch still gets its (empty) result
    tok = build_tiny_tokenizer()
    batch = _batch(tok, ["12 + 30 = 42", "", "the answer is 7", "9", "x", "yy", "zzz"])
    path = tmp_path / "fn.py"
    path.write_text(SCORE_BY_TEXT)
    reward = Reward(tok, custom_fn_path=str(path), background=True, num_workers=3)
    try:
        pending = reward.submit(batch)
        assert len(pending._futures) == 3
        got = pending.result()
    finally:
        reward.close()
    want = Reward(tok, custom_fn_path=str(path)).score(batch)
    assert got.texts == want.texts
    torch.testing.assert_close(got.sequence, want.sequence, rtol=0, atol=0)  # extra_info["row"]: the order
    torch.testing.assert_close(got.token_level, want.token_level, rtol=0, atol=0)
