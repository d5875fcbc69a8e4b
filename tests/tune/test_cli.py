"""`klppo tune --dry-run`: memory-model tables without a GPU, from a named shape and from a config."""

from __future__ import annotations

from klppo.commands.tune import main
from klppo.models.tiny import save_tiny_model_dir


def test_dry_run_named_shape(capsys):
    assert (
        main(
            [
                "--dry-run",
                "--model-shape",
                "Qwen2.5-7B",
                "--world-size",
                "8",
                "--device-gb",
                "80",
                "--micro-tokens",
                "8192",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "7.62B params" in out and "world 8" in out
    assert "sharded params" in out and "KV cache" in out and "logits" in out
    # with 8 ranks the per-unit communication table is printed (assumed link / matmul rates)
    assert "communication per micro-batch" in out and "hidden" in out and "exposed" in out
    # 1e8 is below one 7B decoder layer (233M): its units equal 1e7's and the row is not repeated
    for threshold in ("0", "1e+07", "whole"):
        assert f"│ {threshold:>14} │" in out


def test_dry_run_from_config(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    save_tiny_model_dir(str(model_dir))
    rc = main(
        [
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
            "trainer.n_gpus_per_node=2",
            "--dry-run",
            "--device-gb",
            "1",
            "--thresholds",
            "0,1000000000000",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())  # the table's title wraps where the model's path is long (xdist's tmp)
    assert "world 2" in words and "tokens=2048" in words, out
    assert "│   1024 │" in out and "│   2048 │" in out, out  # ½× and 1× the configured token budget


def test_dry_run_of_the_7b_recipe_shows_host_and_checkpoint(capsys):
    """The 7B recipe (optimizer step on the CPU, reference offloaded): the host's peak per point and term by
    term, the refusal on a host too small, one checkpoint per setting."""
    args = [
        "examples/qwen7b_grpo_one_gpu.yaml",
        "--dry-run",
        "--model-shape",
        "Qwen2.5-7B",
        "--thresholds",
        "0",
    ]
    assert main([*args, "--host-gb", "128"]) == 0
    out = capsys.readouterr().out
    assert "device 80 GiB, host 128 GiB" in out
    # the configured mode joins the grid: device 56.7 GiB in the update, 111.4 GiB on the host
    assert "│   8192 │    40.0 │     21.1 │   56.7 │    25.8 │ 111.4 │  yes │" in out
    for term in (
        "│ host     │ masters               │  28.37 │",
        "│ host     │ optimizer (AdamW)     │  56.74 │",
    ):
        assert term in out
    assert "refused" not in out
    assert "│ as configured " in out and "│   28.37 │           56.74 │           0.00 │ 85.11 │" in out
    assert "│ actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 " in out and "│ 42.56 │" in out
    assert "│ checkpoint │ total                        │ 85.11 │" in out
    assert main([*args, "--host-gb", "100"]) == 0
    out = capsys.readouterr().out
    assert "│ 111.4 │ no (host) │" in out
    assert "a run is refused at its start: the host is predicted to need 111.4 GiB of its 100 GiB" in out
