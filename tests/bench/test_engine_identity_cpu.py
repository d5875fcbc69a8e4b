"""bench/engine_identity.py on CPU: the engine against its own saved outputs is identical; against outputs
whose log-probs moved, not."""

from __future__ import annotations

import torch

from bench.engine_identity import main
from tests.bench.gate import device_bench_run


@device_bench_run
def test_identity_and_shifted_outputs_on_cpu(tmp_path) -> None:
    common = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32"]
    saved = tmp_path / "old.pt"
    main(["--save", str(saved), *common])
    same = main(["--against", str(saved), *common])
    assert same["greedy_tokens_identical"] and same["sampled_tokens_identical"]
    assert same["greedy_log_prob_max_diff"] == 0.0 and same["sampled_log_prob_max_diff"] == 0.0
    shifted = torch.load(saved)
    for mode in ("greedy", "sampled"):
        shifted[mode]["log_probs"] = shifted[mode]["log_probs"] + 1e-3
    torch.save(shifted, saved)
    moved = main(["--against", str(saved), *common, "--out", str(tmp_path / "identity.json")])
    assert moved["greedy_tokens_identical"] and abs(moved["greedy_log_prob_max_diff"] - 1e-3) < 1e-6
    assert (tmp_path / "identity.json").exists()
