"""bench/multi_turn.py on the CPU (``--tiny``): the counting model's turns have the planned lengths, the
engine's session and the re-send path give the same tokens, and every mode reports its throughput."""

from __future__ import annotations

import json

import pytest
import torch

from bench.multi_turn import counting_model, main


def test_the_counting_model_counts() -> None:
    model = counting_model("tiny", torch.float32, "cpu", vocab=512)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[7, 300, 41, 99]])).logits[0]
    assert logits.argmax(dim=-1).tolist() == [8, 301, 42, 100]


@pytest.mark.slow  # about 6 s on 2 cores
def test_tiny_run(tmp_path) -> None:
    out = tmp_path / "multi_turn.json"
    main(["--tiny", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["one_turn", "two_turn_kv", "two_turn_resend"]
    assert all(r["tokens_as_planned"] and r["same_tokens"] and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["vs_one_turn"] == 1.0 and rows[1]["model_tokens"] == 4 * 2 * 12
