"""χ² of the samplers' draws at many draws: tells a sampler's bias from a test's chance failure.

    python3 bench/sampler_chi.py [--draws 1000000] [--seeds 3] [--sampler triton] [--out chi.json]

``tests/rollout/test_sampling.py`` runs each setting once at 5·10⁴–2·10⁵ draws with p > 0.01; a bias that
shows there gives p ≈ 0 at 10⁶ draws, while a chance failure gives a p spread over (0, 1) with other seeds.
Rows (each p over ``--seeds`` seeds):

- ``chunked``: the untruncated Triton kernel on the test's 40 logits (block 16: one program a row or three),
  temperature 0.9 or 1 (4 settings); ``--sampler torch`` draws the same law with the torch path (one row per
  temperature);
- ``vocab``: 64 finite logits among Qwen's 151,936, flat or peaked (σ = 4) (``--vocab-draws`` draws in
  batches under the kernels' 2³¹-logit limit; Triton only).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from klppo.rollout.base import SamplingParams
from klppo.rollout.sampling import sample
from tests.rollout.test_sampling import _logits, chi_square_p, reference


def chunked_rows(sampler: str, draws: int, seeds: int, device: str) -> list[dict]:
    from klppo.rollout.triton_sampling import sample_triton

    if sampler == "torch":
        settings = [dict(t=t) for t in (0.9, 1.0)]
    else:
        settings = [dict(splits=s, t=t) for s, t in itertools.product((1, 3), (0.9, 1.0))]
    rows = []
    for setting in settings:
        t = setting["t"]
        law = reference(_logits(), t, -1, 1.0)[0]
        params = SamplingParams(max_new_tokens=1, temperature=t)
        ps = []
        for seed in range(seeds):
            torch.manual_seed(100 + seed)
            x = _logits().to(device).expand(draws, -1).contiguous()
            if sampler == "torch":
                tokens, _, _ = sample(x, params)
            else:
                tokens, _, _ = sample_triton(x, params, splits=setting["splits"], block=16)
            ps.append(round(chi_square_p(tokens, law), 4))
        rows.append(dict(part="chunked", sampler=sampler, draws=draws, **setting, p=ps))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def vocab_rows(draws: int, device: str, vocab: int = 151936, kept: int = 64) -> list[dict]:
    from klppo.rollout.triton_sampling import sample_triton

    rows = []
    per_call = min(draws, (2**31 - 1) // vocab)
    for name, scale in (("flat", 0.0), ("peaked", 4.0)):
        g = torch.Generator().manual_seed(5)
        values = torch.randn(kept, generator=g) * scale
        ids = torch.randperm(vocab, generator=g)[:kept]
        row = torch.full((vocab,), float("-inf"))
        row[ids] = values
        batch = row.to(device).expand(per_call, -1).contiguous()
        torch.manual_seed(7)
        tokens = torch.cat(
            [sample_triton(batch, SamplingParams(max_new_tokens=1))[0] for _ in range(-(-draws // per_call))]
        )[:draws].cpu()
        position = (tokens[:, None] == ids[None, :]).float().argmax(1)
        assert torch.isin(tokens, ids).all(), "a token outside the finite logits was drawn"
        p = chi_square_p(position, torch.softmax(values.double(), 0))
        rows.append(dict(part="vocab", case=name, draws=draws, p=round(p, 4)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sampler", choices=("triton", "torch"), default="triton")
    ap.add_argument("--draws", type=int, default=1_000_000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--vocab-draws", type=int, default=400_000, help="0: no vocab rows")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = chunked_rows(args.sampler, args.draws, args.seeds, args.device)
    if args.sampler == "triton" and args.vocab_draws:
        rows += vocab_rows(args.vocab_draws, args.device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
