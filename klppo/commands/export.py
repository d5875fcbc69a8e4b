"""`klppo export CKPT_DIR OUT_DIR [--role actor|critic] [--overwrite]`: a checkpoint's weights as a Hugging
Face directory (config, generation config, tokenizer, safetensors) that transformers loads directly.

``OUT_DIR`` must be absent or empty: a non-empty directory (a base model's, an earlier export) is refused
unless ``--overwrite`` is given, which then writes over the files of the same names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

from klppo.models.lora import merge_into_base
from klppo.ops.checkpoint import validate_checkpoint
from klppo.parallel.checkpoint import load_checkpoint as load_model_and_optimizer


def check_target(out_dir: Path, *, overwrite: bool) -> None:
    """Refuse a target that is a file, or a non-empty directory without ``overwrite``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a directory")
    if not overwrite and out_dir.is_dir() and any(out_dir.iterdir()):
        raise FileExistsError(
            f"{out_dir} is not empty ({len(list(out_dir.iterdir()))} entries); choose a new directory or pass "
            "--overwrite to write over its files"
        )


def export_checkpoint(
    ckpt_dir: str | Path, out_dir: str | Path, *, role: str = "actor", overwrite: bool = False
) -> Path:
    """Rebuild the role's model from the saved config, load the sharded weights (any world size), save."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    check_target(out_dir, overwrite=overwrite)
    hf_dir = ckpt_dir / role / "huggingface"
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"{ckpt_dir} does not exist (pass a global_step_N folder of a run directory)")
    problem = validate_checkpoint(ckpt_dir, roles=[role])  # the manifest's checksums, before any load
    if problem is not None:
        raise ValueError(f"{ckpt_dir} is damaged: {problem}; export an intact checkpoint")
    if not hf_dir.is_dir():
        raise FileNotFoundError(
            f"{ckpt_dir} holds no {role!r} model (expected {hf_dir}); pass a global_step_N folder"
        )
    config = AutoConfig.from_pretrained(hf_dir)
    auto = AutoModelForTokenClassification if role == "critic" else AutoModelForCausalLM
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = auto.from_config(config, dtype=dtype)
    lora = (hf_dir / "adapter_config.json").exists()
    if lora:  # trained with LoRA: rebuild the same adapters, load, and fold them into the weights
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415  optional extra (klppo[lora])

        model = get_peft_model(model, LoraConfig.from_pretrained(hf_dir))
    load_model_and_optimizer(ckpt_dir / role, model, None)
    if lora:
        model = merge_into_base(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    gen = hf_dir / "generation_config.json"
    if gen.exists():
        (out_dir / "generation_config.json").write_text(gen.read_text())
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="klppo export", description=__doc__)
    parser.add_argument("ckpt_dir", help="a global_step_N checkpoint folder")
    parser.add_argument("out_dir", help="where to write the Hugging Face directory")
    parser.add_argument("--role", choices=["actor", "critic"], default="actor")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty out_dir")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt_dir, args.out_dir, role=args.role, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"klppo export: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
