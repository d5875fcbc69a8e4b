"""Are two klppo engines bit-identical? This tree's ``KLPPORollout`` against another class (e.g. a copy of a
previous commit's package with its imports renamed), on ``bench/rollout.py --check``'s inputs, in one process.

    PYTHONPATH=$PWD:DIR python3 bench/engine_identity.py --old-engine klppo_old.rollout.engine [--out identity.json]

Eight prompts of 64 tokens (every other one left-padded by 17), the Qwen2.5-0.5B shape in bf16 (``--shape``,
``--device``, ``--dtype``: ``tiny``/``cpu``/``float32`` for the script's test): greedy and seeded sampled
generation of 32 tokens by each engine; prints and writes whether tokens and log-probs are identical (and the
largest log-prob difference), and each engine's greedy token match with transformers' ``generate``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import build, check_prompts  # noqa: E402  (bench/ is not a package when run as a script)

from klppo.rollout import SamplingParams, make_rollout  # noqa: E402
from klppo.rollout.engine import KLPPORollout  # noqa: E402

EOS, PAD = [151645], 151643


def compare(old_engine: str, shape: str = "0.5b", device: str = "cuda", dtype: str = "bfloat16") -> dict:
    prompts, mask = check_prompts(device, 151000 if shape != "tiny" else 250)
    model = build(shape, getattr(torch, dtype), device)
    greedy = SamplingParams(max_new_tokens=32, do_sample=False)
    sampled = SamplingParams(max_new_tokens=32, seed=1)
    hf = make_rollout("hf", eos_token_ids=EOS, pad_token_id=PAD).generate(model, prompts, mask, greedy)
    kw = dict(eos_token_ids=EOS, pad_token_id=PAD, gpu_memory_utilization=0.9)
    outs, row = {}, {"shape": shape, "dtype": dtype, "old_engine": old_engine}
    for name, cls in (("new", KLPPORollout), ("old", importlib.import_module(old_engine).KLPPORollout)):
        engine = cls(**kw)
        outs[name] = [engine.generate(model, prompts, mask, p) for p in (greedy, sampled)]
        row[f"{name}_greedy_match_vs_hf"] = (outs[name][0].responses == hf.responses).float().mean().item()
        engine.release()
    for i, mode in enumerate(("greedy", "sampled")):
        new, old = outs["new"][i], outs["old"][i]
        row[f"{mode}_tokens_identical"] = bool(torch.equal(new.responses, old.responses))
        row[f"{mode}_log_prob_max_diff"] = (new.log_probs - old.log_probs).abs().max().item()
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-engine", required=True, help="module with the other KLPPORollout class")
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    row = compare(args.old_engine, args.shape, args.device, args.dtype)
    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
