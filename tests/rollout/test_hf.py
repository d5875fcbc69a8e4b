"""The hf reference backend: contract (shapes, row order, mask, padding), log-probs, seeding."""

from __future__ import annotations

import torch

from klppo.rollout import SamplingParams, make_rollout, response_mask_from_tokens
from klppo.rollout.settings import EngineSettings
from tests.rollout.conftest import left_padded, reference_log_probs


def test_response_mask_counts_first_eos_only() -> None:
    responses = torch.tensor([[5, 2, 2, 2], [5, 6, 7, 8], [2, 9, 2, 9], [3, 4, 9, 2]])
    mask = response_mask_from_tokens(responses, [2, 9])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]])
    assert torch.equal(mask, expected)
    assert torch.equal(response_mask_from_tokens(responses, [2], ignore_eos=True), torch.ones_like(mask))


def test_hf_sampling_contract_and_log_probs(tiny_qwen2, prompt_batch) -> None:
    prompts, prompt_mask = prompt_batch
    engine = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2))
    params = SamplingParams(max_new_tokens=12, n=3, temperature=0.7, top_k=20, top_p=0.9, seed=3)
    out = engine.generate(tiny_qwen2, prompts, prompt_mask, params)
    assert out.responses.shape == (12, 12) and out.responses.dtype == torch.long
    assert out.log_probs.dtype == torch.float32
    ref = reference_log_probs(tiny_qwen2, prompts, prompt_mask, out.responses, out.response_mask, 0.7, 3)
    torch.testing.assert_close(out.log_probs.double(), ref, atol=1e-4, rtol=0)
    # truncated sampling: log-probs are under the untruncated tempered distribution, so not all ~0
    assert (out.log_probs < -0.5).any()
    again = engine.generate(tiny_qwen2, prompts, prompt_mask, params)
    assert torch.equal(out.responses, again.responses)
    other = engine.generate(tiny_qwen2, prompts, prompt_mask, SamplingParams(max_new_tokens=12, n=3, seed=4))
    assert not torch.equal(out.responses, other.responses)


def test_hf_greedy_rows_match_unpadded_and_eos_mask(tiny_qwen2, prompt_batch) -> None:
    prompts, prompt_mask = prompt_batch
    engine = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2))
    params = SamplingParams(max_new_tokens=10, n=2, do_sample=False)
    out = engine.generate(tiny_qwen2, prompts, prompt_mask, params)
    for i in range(prompts.shape[0]):
        single = prompts[i][prompt_mask[i].bool()].unsqueeze(0)
        alone = engine.generate(tiny_qwen2, single, torch.ones_like(single), params)
        assert torch.equal(out.responses[2 * i], alone.responses[0])
        assert torch.equal(out.responses[2 * i + 1], alone.responses[0])  # greedy: n copies
    # make a token the greedy path emits an EOS: the mask must stop right after it, pad after it
    eos = int(out.responses[0, 3])
    engine_eos = make_rollout("hf", EngineSettings(eos_token_ids=[eos], pad_token_id=0))
    cut = engine_eos.generate(tiny_qwen2, prompts[:1], prompt_mask[:1], params)
    first = int((out.responses[0] == eos).nonzero()[0])
    assert cut.response_mask[0].tolist() == [1] * (first + 1) + [0] * (10 - first - 1)
    assert torch.equal(cut.responses[0, : first + 1], out.responses[0, : first + 1])
    assert (cut.responses[0, first + 1 :] == 0).all() and (cut.log_probs[0, first + 1 :] == 0).all()
    assert (cut.log_probs[0, : first + 1] < 0).all()


def test_hf_ignores_model_generation_config(tiny_qwen2) -> None:
    prompts, prompt_mask = left_padded([[1, 10, 20, 30]])
    engine = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2))
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    base = engine.generate(tiny_qwen2, prompts, prompt_mask, params).responses
    tiny_qwen2.generation_config.repetition_penalty = 5.0
    try:
        after = engine.generate(tiny_qwen2, prompts, prompt_mask, params).responses
    finally:
        tiny_qwen2.generation_config.repetition_penalty = 1.0
    assert torch.equal(base, after)
