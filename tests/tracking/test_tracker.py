"""Tracker: jsonl records, value conversion, resume truncation, rank gating, console line and bar,
TensorBoard events, and the optional services through stand-in modules."""

from __future__ import annotations

import io
import json
import math
import sys
import types

import numpy as np
import pytest
import torch

from klppo.tracking import Tracker, TrackerError
from klppo.tracking.backends import MlflowBackend
from klppo.tracking.console import format_step_line
from klppo.tracking.tracker import normalize_logger_names, to_scalars

STEP_METRICS = {
    "critic/score/mean": torch.tensor(0.25),
    "critic/rewards/mean": 0.2,
    "actor/kl_loss": torch.tensor([0.0012], dtype=torch.float64),
    "actor/pg_loss": np.float32(-0.03125),
    "response_length/mean": 87.0,
    "timing_s/step": 10.25,
    "timing_s/gen": 7.125,
    "perf/throughput": 512.4,
    "perf/total_num_tokens": 4096,
}


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tracker(tmp_path, loggers=("jsonl",), **kwargs):
    return Tracker(list(loggers), run_dir=str(tmp_path), project_name="p", experiment_name="e", **kwargs)


def test_to_scalars_types():
    values = to_scalars({**STEP_METRICS, "flag": True, "nan": float("nan")})
    assert list(values) == [*STEP_METRICS, "flag", "nan"]  # order kept
    assert values["critic/score/mean"] == 0.25 and values["actor/pg_loss"] == -0.03125
    assert values["actor/kl_loss"] == 0.0012 and type(values["actor/kl_loss"]) is float
    assert values["perf/total_num_tokens"] == 4096 and type(values["perf/total_num_tokens"]) is int
    assert values["flag"] == 1.0 and math.isnan(values["nan"])
    with pytest.raises(TypeError, match="shape"):
        to_scalars({"x": torch.ones(2)})
    with pytest.raises(TypeError, match="non-numeric"):
        to_scalars({"x": "high"})


def test_jsonl_lines_flushed_and_appended(tmp_path):
    tracker = _tracker(tmp_path, ["file"])  # alias of jsonl
    tracker.log(STEP_METRICS, step=1)
    path = tmp_path / "metrics.jsonl"
    first = _records(path)  # readable before close: flushed per line
    assert first == [{"step": 1, **to_scalars(STEP_METRICS)}]
    tracker.log({"val-core/gsm8k/reward/mean@1": 0.5}, step=1)
    tracker.close()
    tracker.close()  # idempotent
    with _tracker(tmp_path) as again:
        again.log({"critic/score/mean": 1.0}, step=np.int64(2))
    records = _records(path)
    assert [r["step"] for r in records] == [1, 1, 2] and all(type(r["step"]) is int for r in records)
    assert records[1] == {"step": 1, "val-core/gsm8k/reward/mean@1": 0.5}


def test_jsonl_is_strict_json_with_nonfinite_values_named(tmp_path):
    with _tracker(tmp_path) as tracker:
        tracker.log({"a": float("nan"), "b": float("inf"), "c": -float("inf"), "d": 1.5, "n": 3}, step=7)

    def refuse(constant):  # Python's json otherwise accepts the NaN/Infinity extensions
        raise ValueError(f"not JSON: {constant}")

    line = (tmp_path / "metrics.jsonl").read_text().strip()
    record = json.loads(line, parse_constant=refuse)
    assert record == {
        "step": 7,
        "a": None,
        "b": None,
        "c": None,
        "d": 1.5,
        "n": 3,
        "nonfinite": {"a": "nan", "b": "inf", "c": "-inf"},
    }


def test_resume_drops_lines_after_checkpoint(tmp_path):
    with _tracker(tmp_path) as tracker:
        for step in range(0, 6):
            tracker.log({"x": float(step)}, step=step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "x": ')  # a line cut by the crash
    with _tracker(tmp_path, resume_step=3) as tracker:
        tracker.log({"x": 40.0}, step=4)
    assert [(r["step"], r["x"]) for r in _records(tmp_path / "metrics.jsonl")] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
    ]


def test_other_ranks_do_nothing(tmp_path):
    tracker = _tracker(tmp_path / "r1", ["console", "jsonl"], rank=1)
    tracker.set_total_steps(3)
    tracker.log({"x": torch.ones(3)}, step=1)  # not even converted
    tracker.close()
    assert not (tmp_path / "r1").exists()
    with pytest.raises(TrackerError, match="unknown logger 'wandbb'"):
        _tracker(tmp_path, ["console", "wandbb"], rank=1)  # typos fail on every rank


def test_logger_names():
    assert normalize_logger_names("console") == ["console"]
    assert normalize_logger_names(["Console", "file", "jsonl", "tensorboard"]) == [
        "console",
        "jsonl",
        "tensorboard",
    ]
    assert normalize_logger_names(None) == []


@pytest.mark.parametrize("name", ["wandb", "mlflow", "swanlab"])
def test_missing_package_message(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(TrackerError, match=rf"pip install {name}`.*remove '{name}'"):
        _tracker(tmp_path, ["jsonl", name])


def test_console_line_and_validation_line():
    line = format_step_line(to_scalars(STEP_METRICS), 3, 20)
    assert line == (
        "step 3/20 | score 0.25 | reward 0.2 | kl 0.0012 | pg_loss -0.03125 | resp_len 87 | 10.2 s (gen 7.1 "
        "s) | 512 tok/s"
    )
    assert format_step_line({"actor/reward_kl_penalty": 0.5, "actor/pg_loss": float("nan")}, 4) == (
        "step 4 | kl 0.5 | pg_loss nan"
    )
    assert format_step_line({"val-core/gsm8k/reward/mean@1": 0.421875}, 0) == (
        "val @ step 0 | gsm8k/reward/mean@1 0.4219"
    )


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_console_prints_lines_and_moves_bar(tmp_path, monkeypatch, capsys):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    tracker = _tracker(tmp_path, ["console"])
    tracker.set_total_steps(5, initial=1)
    bar = tracker.backends["console"].bar
    assert not bar.disable and bar.n == 1
    tracker.log({"critic/score/mean": 0.5}, step=2)
    tracker.log({"val-core/a/reward/mean@1": 0.5}, step=2)
    assert bar.n == 2
    tracker.log({"critic/score/mean": 0.75}, step=3)
    assert bar.n == 3
    tracker.close()
    out = capsys.readouterr().out.splitlines()
    assert out == ["step 2/5 | score 0.5", "val @ step 2 | a/reward/mean@1 0.5", "step 3/5 | score 0.75"]
    assert "3/5" in terminal.getvalue()


def test_console_without_terminal_prints_progress_on_each_training_line(tmp_path, monkeypatch, capsys):
    from klppo.tracking import console

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar
    clock = iter([100.0, 130.0, 160.0, 161.0])
    monkeypatch.setattr(console.time, "monotonic", lambda: next(clock))
    tracker = _tracker(tmp_path, ["console"])
    tracker.set_total_steps(4, initial=1)  # resumed after step 1
    assert tracker.backends["console"].bar.disable
    tracker.log({"critic/score/mean": 0.5}, step=2)  # 30 s for 1 step, 2 to go
    tracker.log({"critic/score/mean": 0.75}, step=3)  # 60 s for 2 steps, 1 to go
    tracker.log({"val-core/a/reward/mean@1": 0.5}, step=3)
    tracker.log({"critic/score/mean": 1.0}, step=4)
    tracker.close()
    assert capsys.readouterr().out.splitlines() == [
        "step 2/4 | score 0.5 | 50% | 0:30 elapsed | eta 1:00",
        "step 3/4 | score 0.75 | 75% | 1:00 elapsed | eta 0:30",
        "val @ step 3 | a/reward/mean@1 0.5",
        "step 4/4 | score 1 | 100% | 1:01 elapsed",
    ]
    assert [step for step, _ in tracker.history] == [2, 3, 3, 4]
    assert tracker.history[1][1] == {"critic/score/mean": 0.75}


def test_tensorboard_scalars_and_resume_purge(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with _tracker(tmp_path, ["tensorboard"], config_dict={"a": {"b": 1}}) as tracker:
        for step in (1, 2, 3):
            tracker.log({"critic/score/mean": torch.tensor(step / 4), "val-core/x/reward/mean@1": 0.5}, step)
    with _tracker(tmp_path, ["tensorboard"], resume_step=1) as tracker:
        tracker.log({"critic/score/mean": 9.0}, step=2)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scores = [(e.step, e.value) for e in events.Scalars("critic/score/mean")]
    assert scores == [(1, 0.25), (2, 9.0)]  # steps 2, 3 of the first run purged
    assert [e.step for e in events.Scalars("val-core/x/reward/mean@1")] == [1]


def _fake_module(name, calls):
    module = types.ModuleType(name)

    def record(fn_name, result=None):
        def fn(*args, **kwargs):
            calls.append((fn_name, args, kwargs))
            return result

        return fn

    return module, record


def test_wandb_adapter(tmp_path, monkeypatch):
    calls = []
    module, record = _fake_module("wandb", calls)
    run = types.SimpleNamespace(id="run123", log=record("log"), finish=record("finish"))
    module.init = record("init", run)
    monkeypatch.setitem(sys.modules, "wandb", module)
    with _tracker(tmp_path, ["wandb"], config_dict={"lr": 1e-6}) as tracker:
        tracker.log({"critic/score/mean": torch.tensor(0.5)}, step=7)
    assert calls[0][0] == "init" and calls[0][2]["project"] == "p" and calls[0][2]["name"] == "e"
    assert calls[0][2]["config"] == {"lr": 1e-6} and calls[0][2]["id"] is None
    assert calls[1] == ("log", ({"critic/score/mean": 0.5},), {"step": 7})
    assert calls[2][0] == "finish"
    assert (tmp_path / "wandb_run_id.txt").read_text().strip() == "run123"
    calls.clear()
    _tracker(tmp_path, ["wandb"]).close()  # a resumed run continues the same W&B run
    assert calls[0][2]["id"] == "run123" and calls[0][2]["resume"] == "allow"


def test_mlflow_adapter(tmp_path, monkeypatch):
    calls = []
    module, record = _fake_module("mlflow", calls)
    for fn in ("set_tracking_uri", "set_experiment", "start_run", "log_params", "log_metrics", "end_run"):
        setattr(module, fn, record(fn))
    monkeypatch.setitem(sys.modules, "mlflow", module)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with _tracker(tmp_path, ["mlflow"], config_dict={"actor": {"lr": 1e-6}, "n": 4}) as tracker:
        tracker.log({"val-core/gsm8k/reward/mean@4": 0.5, "bad": float("inf")}, step=3)
    by_name = {name: (args, kwargs) for name, args, kwargs in calls}
    assert by_name["set_tracking_uri"][0][0] == (tmp_path / "mlruns").resolve().as_uri()
    assert by_name["set_experiment"][0] == ("p",) and by_name["start_run"][1] == {"run_name": "e"}
    assert by_name["log_params"][0][0] == {"actor.lr": "1e-06", "n": "4"}
    assert by_name["log_metrics"] == (({"val-core/gsm8k/reward/mean_at_4": 0.5},), {"step": 3})
    assert "end_run" in by_name
    assert MlflowBackend.sanitize("a b/c:d@1#x") == "a b/c:d_at_1_x"


def test_swanlab_adapter(tmp_path, monkeypatch):
    calls = []
    module, record = _fake_module("swanlab", calls)
    for fn in ("init", "log", "finish"):
        setattr(module, fn, record(fn))
    monkeypatch.setitem(sys.modules, "swanlab", module)
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    with _tracker(tmp_path, ["swanlab"]) as tracker:
        tracker.log({"x": 1}, step=1)
    assert calls[0][2] == {
        "project": "p",
        "experiment_name": "e",
        "config": {},
        "logdir": str(tmp_path / "swanlog"),
        "mode": "offline",
    }
    assert calls[1] == ("log", ({"x": 1},), {"step": 1}) and calls[2][0] == "finish"
