"""`klppo data log` with top-k sampling: each row holds the log-probs of the truncated law its tokens were
drawn from (a float64 forward of the model, truncated, as the oracle), the log of that law's kept mass, and
its sampling settings; with ``--reference``, the samples' KL to another model."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.rollout.conftest import reference_log_probs
from tests.trainer.conftest import arithmetic_data, tiny_model_dir  # noqa: F401  (fixtures)
from tests.trainer.utils import base_overrides


def _read_log(out, tokenizer_dir):
    """The 4 prompts × 2 samples of a log written by the tests below, as one batch in file order."""
    from klppo.data.logged import LoggedLoader, LoggedSettings
    from klppo.models.loading import load_tokenizer

    settings = LoggedSettings(
        [str(out)],
        groups_per_batch=4,
        samples_per_group=2,
        max_prompt_length=64,
        max_response_length=8,
        vocab_size=10**6,
        shuffle=False,
    )
    return LoggedLoader(settings, load_tokenizer(str(tokenizer_dir))).next_batch()


def test_truncated_log_holds_the_law_sampled_from(tiny_model_dir, arithmetic_data, tmp_path):  # noqa: F811
    from klppo.commands.log_data import main

    out = tmp_path / "log.parquet"
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "unused") + [
        "actor_rollout_ref.rollout.name=klppo",
        "actor_rollout_ref.rollout.top_k=5",
        "actor_rollout_ref.rollout.temperature=0.9",
    ]
    assert main(["--output", str(out), "--n", "2", "--num-prompts", "4", *overrides]) == 0
    rows = pq.read_table(out).to_pylist()
    assert len(rows) == 8
    assert all((r["temperature"], r["top_p"], r["top_k"]) == (0.9, 1.0, 5) for r in rows)
    batch = _read_log(out, tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    args = (model, batch.prompts, batch.prompt_mask, batch.responses, batch.response_mask, 0.9, 1)
    truncated, full = reference_log_probs(*args, top_k=5), reference_log_probs(*args)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(batch.rollout_log_probs.double()[mask], truncated[mask], atol=1e-4, rtol=0)
    assert (truncated[mask] > full[mask] + 0.1).all()  # top-5 of the tiny vocabulary: far from the softmax
    # the kept mass completes them to the full softmax, which rollout/log_prob_diff compares like with like
    softmax = (batch.rollout_log_probs + batch.rollout_log_kept_mass).double()
    torch.testing.assert_close(softmax[mask], full[mask], atol=1e-4, rtol=0)


def test_kl_to_a_reference_on_the_logged_samples(tiny_model_dir, arithmetic_data, tmp_path, capsys):  # noqa: F811
    """``--reference``: the samples' KL to another model, k3 and k1 per response token, against float64
    forwards of both models on the logged rows; 0 against the model itself."""
    from klppo.commands.log_data import main
    from klppo.models.tiny import save_tiny_model_dir

    other = save_tiny_model_dir(tmp_path / "other", num_layers=2, hidden_size=64, seed=7)
    out = tmp_path / "log.parquet"
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "unused") + [
        "actor_rollout_ref.rollout.name=klppo",
        "actor_rollout_ref.rollout.temperature=0.9",
    ]
    argv = ["--output", str(out), "--n", "2", "--num-prompts", "4", *overrides]
    assert main([*argv, "--reference", str(other)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    batch = _read_log(out, tiny_model_dir)
    args = (batch.prompts, batch.prompt_mask, batch.responses, batch.response_mask, 0.9, 1)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).eval()
    mask = batch.response_mask.bool()
    delta = (reference_log_probs(ref, *args) - reference_log_probs(policy, *args))[mask]
    k3, k1 = float((delta.exp() - delta - 1).mean()), float(-delta.mean())
    assert k3 > 0.01  # two random models: a KL far from 0
    pattern = rf"KL to the reference {re.escape(str(other))} on (\d+) response tokens: k3 (\S+), k1 (\S+) "
    found = re.fullmatch(pattern + "per token", line)
    assert found and int(found[1]) == int(mask.sum()), line
    assert float(found[2]) == pytest.approx(k3, rel=2e-3) and float(found[3]) == pytest.approx(k1, rel=2e-3)

    assert main([*argv, "--reference", str(tiny_model_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("k3 0, k1 0 per token")

    greedy = [*argv, "actor_rollout_ref.rollout.temperature=0", "--reference", str(other)]
    assert main(greedy) == 2
    assert "--reference needs sampled responses" in capsys.readouterr().err

    wider = save_tiny_model_dir(tmp_path / "wider", num_layers=2, hidden_size=64, vocab_size=512)
    capsys.readouterr()  # the save's progress bars
    assert main([*argv, "--reference", str(wider)]) == 2
    err = capsys.readouterr().err
    assert f"--reference {wider}: a vocabulary of 512 tokens" in err and len(err.strip().splitlines()) == 1
