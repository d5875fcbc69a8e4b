"""The reference backend: transformers ``generate``.

Slow (the host drives every decode step) but simple and trusted: it is what the ``klppo`` engine is
tested against, and the fallback for architectures that engine does not support.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from klppo.algorithms.sampling import truncate_logits, truncated_log_probs
from klppo.rollout.base import RolloutOutput, SamplingParams, response_mask_from_tokens, seeded
from klppo.rollout.sampling import returns_law_log_probs


class HFRollout:
    """``generate`` with a fresh generation config per call (the model's own defaults are ignored);
    log-probs ``log_softmax(logits / T)[token]`` of the raw ``output_logits`` (and, truncated, the log-probs
    under the truncated distribution of the same logits). ``cache_implementation=
    "static"`` (with the model compiled by the caller) is the fast ``hf`` path."""

    def __init__(
        self, *, eos_token_ids: list[int], pad_token_id: int, cache_implementation: str | None = None
    ) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.cache_implementation = cache_implementation

    def _generation_config(self, params: SamplingParams):
        greedy = params.greedy
        return GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_k=None if greedy else max(params.top_k, 0),
            top_p=None if greedy else params.top_p,
            num_beams=1,
            repetition_penalty=1.0,
            num_return_sequences=1 if greedy else params.n,
            eos_token_id=None if params.ignore_eos else self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            bos_token_id=None,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
            cache_implementation=self.cache_implementation,
        )

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
    ) -> RolloutOutput:
        """See :mod:`klppo.rollout.base` for the contract."""
        device = prompts.device
        num_prompt_tokens = prompts.shape[1]
        start = time.perf_counter()
        # generate() fills unset fields from model.generation_config: a blank one lets only ``params`` decide
        saved_config = model.generation_config
        model.generation_config = GenerationConfig()
        try:
            with seeded(params.seed, device):
                out = model.generate(
                    input_ids=prompts,
                    attention_mask=prompt_mask,
                    generation_config=self._generation_config(params),
                )
        finally:
            model.generation_config = saved_config
        generated = out.sequences[:, num_prompt_tokens:]
        log_probs, truncated = _step_log_probs(out.logits, generated, params)
        if params.greedy and params.n > 1:  # generate refuses n > 1 without sampling: all n are equal
            generated = generated.repeat_interleave(params.n, dim=0)
            log_probs = log_probs.repeat_interleave(params.n, dim=0)

        num_rows, num_steps = generated.shape
        width = params.max_new_tokens
        responses = torch.full((num_rows, width), self.pad_token_id, dtype=torch.long, device=device)
        responses[:, :num_steps] = generated
        mask = response_mask_from_tokens(responses, self.eos_token_ids, ignore_eos=params.ignore_eos)
        mask[:, num_steps:] = 0
        padded = [
            None if lp is None else F.pad(lp, (0, width - num_steps)) * mask for lp in (log_probs, truncated)
        ]
        responses = torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_token_id))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        stats = {
            "rollout/time_s": time.perf_counter() - start,
            "rollout/tokens_generated": float(mask.sum().item()),
        }
        return RolloutOutput(responses, mask, padded[0], stats, truncated_log_probs=padded[1])

    def release(self) -> None:
        """Nothing to free: ``generate`` allocates its cache per call."""


def _step_log_probs(
    logits: tuple[torch.Tensor, ...], generated: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[N, T] log-probs of ``generated`` under each step's logits / T and, where ``params`` truncate, under
    the truncated distribution (else None), step by step (no [N, T, V] tensor)."""
    full, cut = [], []
    for t, step in enumerate(logits):
        x, token = step.float() / (1.0 if params.greedy else params.temperature), generated[:, t]
        full.append(x.gather(-1, token[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1))
        if returns_law_log_probs(params):
            cut.append(truncated_log_probs(x, truncate_logits(x, params.top_k, params.top_p), token))
    return torch.stack(full, dim=1), torch.stack(cut, dim=1) if cut else None
