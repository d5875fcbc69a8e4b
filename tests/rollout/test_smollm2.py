"""SmolLM2-135M-Instruct (GGUF, converted by klppo, computed in fp32): klppo greedy identical to hf greedy on
CPU."""

from __future__ import annotations

import pytest
import torch

from klppo.rollout import SamplingParams, make_rollout
from klppo.rollout.settings import EngineSettings
from tests.rollout.conftest import left_padded


@pytest.mark.xdist_group("smollm2")  # one worker converts the GGUF for both tests
@pytest.mark.slow  # the GGUF's conversion (~20 s of CPU) is shared with tests/models/test_gguf.py
def test_smollm2_greedy_identical_to_hf(smollm2_conversion) -> None:
    from klppo.models.loading import load_causal_lm

    # the dequantised weights, as klppo converts them once (bf16), computed in fp32
    model = load_causal_lm(smollm2_conversion[1], dtype=torch.float32).eval()
    im_end = 2  # <|im_end|>: the chat EOS, and SmolLM2's pad
    generator = torch.Generator().manual_seed(0)
    rows = [[1, *torch.randint(10, 49000, (length,), generator=generator).tolist()] for length in (12, 5, 9)]
    prompts, prompt_mask = left_padded(rows, pad_id=im_end)
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    ref = make_rollout("hf", EngineSettings(eos_token_ids=[im_end], pad_token_id=im_end)).generate(
        model, prompts, prompt_mask, params
    )
    engine = make_rollout(
        "klppo",
        EngineSettings(eos_token_ids=[im_end], pad_token_id=im_end, max_num_seqs=2, eos_check_every=4),
    )
    out = engine.generate(model, prompts, prompt_mask, params)
    assert model.config.tie_word_embeddings
    assert torch.equal(out.responses, ref.responses)
    assert torch.equal(out.response_mask, ref.response_mask)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-4, rtol=0)
