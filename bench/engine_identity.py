"""Are two revisions of the klppo engine bit-identical? Each revision saves its outputs on ``bench/rollout.py
--check``'s inputs; a second run compares its own with a saved file.

    PYTHONPATH=$PWD python3 bench/engine_identity.py --save old.pt            # in the other revision's
    worktree PYTHONPATH=$PWD python3 bench/engine_identity.py --against old.pt [--out identity.json]

Eight prompts of 64 tokens (every other one left-padded by 17), the Qwen2.5-0.5B shape in bf16 (``--shape``,
``--device``, ``--dtype``: ``tiny``/``cpu``/``float32`` for the script's test): greedy and seeded sampled
generation of 32 tokens; ``--against`` prints and writes whether tokens and log-probs are identical (and the
largest log-prob difference), and this revision's greedy token match with transformers' ``generate``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import build, check_prompts  # noqa: E402  (bench/ is not a package when run as a script)

from klppo.rollout import EngineSettings, SamplingParams, make_rollout  # noqa: E402

EOS, PAD = [151645], 151643
MODES = ("greedy", "sampled")


def outputs(shape: str = "0.5b", device: str = "cuda", dtype: str = "bfloat16") -> dict[str, dict]:
    """This revision's engine outputs (tokens and log-probs, on the CPU) for each of ``MODES``, and hf's
    greedy tokens."""
    torch.manual_seed(0)  # the same prompts in every revision's run
    prompts, mask = check_prompts(device, 151000 if shape != "tiny" else 250)
    model = build(shape, getattr(torch, dtype), device)
    params = dict(
        greedy=SamplingParams(max_new_tokens=32, do_sample=False),
        sampled=SamplingParams(max_new_tokens=32, seed=1),
    )
    settings = EngineSettings(eos_token_ids=EOS, pad_token_id=PAD, gpu_memory_utilization=0.9)
    engine = make_rollout("klppo", settings)
    hf = make_rollout("hf", settings).generate(model, prompts, mask, params["greedy"])
    result = {"hf": {"responses": hf.responses.cpu()}}
    for mode in MODES:
        out = engine.generate(model, prompts, mask, params[mode])
        result[mode] = {"responses": out.responses.cpu(), "log_probs": out.log_probs.cpu()}
    return result


def compare(mine: dict, theirs: dict) -> dict:
    """Identity of tokens and log-probs per mode, and this revision's greedy match with hf."""
    row = {
        "greedy_match_vs_hf": (mine["greedy"]["responses"] == mine["hf"]["responses"]).float().mean().item()
    }
    for mode in MODES:
        a, b = mine[mode], theirs[mode]
        row[f"{mode}_tokens_identical"] = bool(torch.equal(a["responses"], b["responses"]))
        row[f"{mode}_log_prob_max_diff"] = (a["log_probs"] - b["log_probs"]).abs().max().item()
    return row


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--save", default=None, help="write this revision's outputs here (torch.save)")
    ap.add_argument("--against", default=None, help="compare with the outputs another revision saved")
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not (args.save or args.against):
        ap.error("give --save, --against or both")
    mine = outputs(args.shape, args.device, args.dtype)
    if args.save:
        torch.save(mine, args.save)
    if not args.against:
        return None
    row = compare(mine, torch.load(args.against))
    print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
