"""`klppo export` writes the dtype of the model the run started from (a bf16 model exports as bf16, not as
the fp32 master weights the checkpoint holds) unless `--dtype` says otherwise, and says what it wrote."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from klppo.assembly.roles_build import hf_writer, stored_dtype
from klppo.commands.export import main as export_main
from klppo.models.loading import load_tokenizer
from klppo.models.tiny import save_tiny_model_dir
from klppo.ops.checkpoint import write_manifest
from klppo.parallel.checkpoint import save_checkpoint


def _bf16_run_checkpoint(tmp_path):
    """A checkpoint as a run from a bf16 model writes it: fp32 masters (moved off their bf16 values) and the
    config written by the actor's ``hf_writer``; returns (checkpoint, the masters' state)."""
    start = tmp_path / "bf16_model"
    AutoModelForCausalLM.from_pretrained(
        save_tiny_model_dir(tmp_path / "fp32_model", num_layers=1, hidden_size=32), dtype=torch.bfloat16
    ).save_pretrained(start)
    tokenizer = load_tokenizer(str(tmp_path / "fp32_model"))
    masters = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    with torch.no_grad():
        for p in masters.parameters():
            p.add_(1e-4 * torch.randn_like(p))  # trained: no longer bf16 values
    checkpoint = tmp_path / "run" / "global_step_1"
    save_checkpoint(checkpoint / "actor", masters, None)
    hf_writer(masters, tokenizer, start_dtype=stored_dtype(str(start)))(checkpoint / "actor" / "huggingface")
    for name in ("trainer_state.pt", "rng/rank_0.pt"):
        (checkpoint / name).parent.mkdir(parents=True, exist_ok=True)
        (checkpoint / name).write_bytes(b"x")
    write_manifest(checkpoint, 1)
    (checkpoint / "COMPLETE").write_text("1")
    return checkpoint, masters.state_dict()


def test_export_writes_the_starting_dtype_and_says_what_it_wrote(tmp_path, capsys):
    checkpoint, masters = _bf16_run_checkpoint(tmp_path)
    out = tmp_path / "hf"
    assert export_main([str(checkpoint), str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"klppo export: wrote {out} (actor)"
    assert lines[1] == "  dtype: bfloat16 (the dtype of the model the run started from; --dtype to change)"
    assert lines[2].startswith("  size: ") and " of weights in 1 file (safetensors)" in lines[2]
    assert lines[3] == f"  load: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})"
    assert lines[4] == f"  train from it: klppo train actor_rollout_ref.model.path={out}"
    written = load_file(out / "model.safetensors")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    for name, tensor in written.items():  # the masters rounded once, to bf16
        assert torch.equal(tensor, masters[name].to(torch.bfloat16)), name
    # --dtype fp32: the master weights themselves
    assert export_main([str(checkpoint), str(tmp_path / "fp32"), "--dtype", "fp32"]) == 0
    assert "  dtype: float32 (as --dtype asked)" in capsys.readouterr().out.splitlines()
    for name, tensor in load_file(tmp_path / "fp32" / "model.safetensors").items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, masters[name]), name
