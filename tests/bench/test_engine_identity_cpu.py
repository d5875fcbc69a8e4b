"""bench/engine_identity.py on CPU: the engine against itself is identical; against a class that moves its
log-probs, not."""

from __future__ import annotations

from bench.engine_identity import main
from tests.bench.gate import device_bench_run

SHIFTED = """
from klppo.rollout.engine import KLPPORollout as Base


class KLPPORollout(Base):
    def generate(self, *args, **kwargs):
        out = super().generate(*args, **kwargs)
        out.log_probs = out.log_probs + 1e-3 * out.response_mask
        return out
"""


@device_bench_run
def test_identity_and_a_shifted_engine_on_cpu(tmp_path, monkeypatch) -> None:
    common = ["--shape", "tiny", "--device", "cpu", "--dtype", "float32"]
    same = main(["--old-engine", "klppo.rollout.engine", *common])
    assert same["greedy_tokens_identical"] and same["sampled_tokens_identical"]
    assert same["greedy_log_prob_max_diff"] == 0.0 and same["sampled_log_prob_max_diff"] == 0.0
    (tmp_path / "shifted_engine.py").write_text(SHIFTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    shifted = main(["--old-engine", "shifted_engine", *common, "--out", str(tmp_path / "identity.json")])
    assert shifted["greedy_tokens_identical"] and abs(shifted["greedy_log_prob_max_diff"] - 1e-3) < 1e-6
    assert (tmp_path / "identity.json").exists()
