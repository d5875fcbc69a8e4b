"""`klppo export CKPT_DIR OUT_DIR [--role actor|critic] [--dtype auto|bf16|fp16|fp32] [--base DIR]
[--overwrite]`: a checkpoint's weights as a Hugging Face directory (config, generation config, tokenizer,
safetensors) that transformers loads directly, and a few lines saying what was written (path, dtype, size,
how to load it).

A LoRA checkpoint that holds its adapters without their base weights (``<role>/base_model.json``) exports
the adapters merged into the base it records: read from the recorded path, or from ``--base`` (the base
moved), and refused when that model is not the recorded one (architecture and weights' digest).

The weights are written in the dtype of the model the run started from (``--dtype auto``: a bf16 model
exports as bf16, not as the fp32 master weights the checkpoint holds); ``--dtype`` chooses another. A
checkpoint that does not record its starting dtype exports in the dtype it names (fp32).

``OUT_DIR`` must be absent or empty: a non-empty directory (a base model's, an earlier export) is refused
unless ``--overwrite`` is given, which then writes over the files of the same names."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from klppo.config.flags import FlagParser
from klppo.models.lora import merge_into_base
from klppo.ops.checkpoint import load_role, read_base_record, validate_checkpoint
from klppo.ops.resume_check import base_mismatch, base_record


def check_target(out_dir: Path, *, overwrite: bool) -> None:
    """Refuse a target that is a file, or a non-empty directory without ``overwrite``."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a directory")
    if not overwrite and out_dir.is_dir() and any(out_dir.iterdir()):
        raise FileExistsError(
            f"{out_dir} is not empty ({len(list(out_dir.iterdir()))} entries); choose a new directory or "
            "pass --overwrite to write over its files"
        )


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def export_checkpoint(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    role: str = "actor",
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
    base: str | Path | None = None,
) -> Path:
    """Rebuild the role's model from the saved config in fp32 (or, for adapters saved without their base, load
    the base from ``base`` or the recorded path), load the sharded weights (any world size), fold LoRA
    adapters in, cast to ``dtype`` (None: the saved config's, the starting model's), save."""
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
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    record = read_base_record(ckpt_dir / role)
    if record is None:  # every weight is in the checkpoint
        model = auto.from_config(config, dtype=torch.float32)  # the masters load exactly, merged in fp32
    else:
        model = auto.from_pretrained(_base_dir(record, base), config=config, dtype=torch.float32)
    lora = (hf_dir / "adapter_config.json").exists()
    if lora:  # trained with LoRA: rebuild the same adapters, load, and fold them into the weights
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415  optional extra (klppo[lora])

        model = get_peft_model(model, LoraConfig.from_pretrained(hf_dir))
    with warnings.catch_warnings():  # one process on purpose: not worth a warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        load_role(ckpt_dir / role, model, None)
    if lora:
        model = merge_into_base(model)
    model = model.to(dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    gen = hf_dir / "generation_config.json"
    if gen.exists():
        (out_dir / "generation_config.json").write_text(gen.read_text())
    return out_dir


def _base_dir(record: dict, base: str | Path | None) -> Path:
    """The base model the adapters apply to: ``base`` or the recorded path, checked against the record."""
    path = Path(base if base is not None else record.get("path", "")).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the base model {path} is not a model directory; pass the base the adapters were trained on "
            "with --base DIR"
        )
    problem = base_mismatch(record, base_record(path))
    if problem is not None:
        raise ValueError(f"--base {path} has {problem}; pass the base the adapters were trained on")
    return path


def _megabytes(num_bytes: int) -> str:
    mb = num_bytes / 1e6
    return f"{mb:,.0f} MB" if mb >= 10 else f"{mb:.2g} MB"


def describe_export(out_dir: Path, *, role: str, chosen: bool) -> list[str]:
    """What an export wrote: the folder, the dtype (and whose it is), the size, and how to load it."""
    config = AutoConfig.from_pretrained(out_dir)
    dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    weights = sorted(out_dir.glob("*.safetensors"))
    size, files = (
        sum(p.stat().st_size for p in weights),
        f"{len(weights)} file{'s' if len(weights) != 1 else ''}",
    )
    auto = "AutoModelForTokenClassification" if role == "critic" else "AutoModelForCausalLM"
    whose = "as --dtype asked" if chosen else "the dtype of the model the run started from; --dtype to change"
    lines = [
        f"klppo export: wrote {out_dir} ({role})",
        f"  dtype: {dtype} ({whose})",
        f"  size: {_megabytes(size)} of weights in {files} (safetensors), with config and tokenizer",
        f"  load: transformers.{auto}.from_pretrained({str(out_dir)!r})",
    ]
    if role == "actor":
        lines.append(f"  train from it: klppo train actor_rollout_ref.model.path={out_dir}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(prog="klppo export", description=__doc__)
    parser.add_argument("ckpt_dir", help="a global_step_N checkpoint folder")
    parser.add_argument("out_dir", help="where to write the Hugging Face directory")
    parser.add_argument("--role", choices=["actor", "critic"], default="actor")
    parser.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="dtype of the written weights (auto: the dtype of the model the run started from)",
    )
    parser.add_argument(
        "--base",
        default=None,
        help="the base model of a LoRA checkpoint saved without it (default: the path it records)",
    )
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty out_dir")
    args = parser.parse_args(argv)
    hf_logging.disable_progress_bar()  # the lines below say what was written
    try:
        out = export_checkpoint(
            args.ckpt_dir,
            args.out_dir,
            role=args.role,
            overwrite=args.overwrite,
            dtype=DTYPES.get(args.dtype),
            base=args.base,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        print(f"klppo export: {exc}", file=sys.stderr)
        return 2
    print("\n".join(describe_export(out, role=args.role, chosen=args.dtype != "auto")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
