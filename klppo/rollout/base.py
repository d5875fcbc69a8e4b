"""The rollout contract: sampling parameters, outputs and the engine protocol.

An engine turns left-padded prompts into right-padded responses on the model it is given:

- ``prompts`` [B, P] int64, left-padded; ``prompt_mask`` [B, P] (1 = real prompt token).
- Output rows are ``B * n``: prompt ``i``'s ``j``-th sample is row ``i * n + j``.
- ``responses`` [B*n, R] int64 with ``R = max_new_tokens`` always, right-padded with ``pad_token_id``.
- ``response_mask`` [B*n, R] int64: 1 on generated tokens up to and including the first EOS, 0 after.
  Never derived from ``responses != pad_token_id`` (pad may equal EOS, as in SmolLM2).
- ``log_probs`` [B*n, R] float32: ``log softmax(logits / temperature)[token]`` for each sampled token,
  i.e. *before* top-k / top-p truncation — the quantity the actor's recomputation gives. Greedy
  (``do_sample=False`` or ``temperature == 0``) uses temperature 1. Zero where the mask is 0.
- ``truncated_log_probs`` [B*n, R] float32 where top-k / top-p truncated the distribution, else None:
  ``log q(token)`` under the truncated, renormalised distribution sampled from, ``log_probs`` − the log of
  the kept set's mass (:mod:`klppo.algorithms.sampling`). Zero where the mask is 0.

Engines know nothing of losses. The caller hands a module whose parameters are full tensors for the
duration of ``generate``, except to an engine with ``reads_shards`` (the tensor-parallel one,
:mod:`klppo.rollout.tp`), which takes the FSDP2-sharded module as it is and reshards it itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``top_k <= 0`` and ``top_p >= 1`` mean "off"; greedy if not ``do_sample``."""

    max_new_tokens: int = 256
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    seed: int | None = None
    ignore_eos: bool = False
    """Generate exactly ``max_new_tokens`` for every row (benchmarks); the mask is then all ones."""
    law_log_probs: bool = True
    """Truncated draws also return log-probs under the law sampled from (``truncated_log_probs``); False where
    nothing reads them (no rollout correction): the Triton sampler then skips its kept-mass pass."""

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature <= 0.0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class RolloutOutput:
    """Responses for ``B * n`` rows (see the module docstring for shapes and the row order), and figures
    about the call that produced them (``rollout/time_s``, ``rollout/tokens_generated``, … — metric names)."""

    responses: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    stats: dict[str, float] = dataclasses.field(default_factory=dict)
    response_attention_mask: torch.Tensor | None = None
    """[B*n, R]: 1 on every response token the model attends to, where a multi-turn rollout appended tool or
    user tokens (``response_mask`` 0 there); None: equals ``response_mask``."""
    extras: list[dict] | None = None
    """One dict per row for the reward function's ``extra_info`` (multi-turn: turns, scores), or None."""
    truncated_log_probs: torch.Tensor | None = None
    """[B*n, R] the log-probs under the truncated distribution sampled from (module docstring), or None."""

    def __post_init__(self) -> None:
        assert self.responses.shape == self.response_mask.shape == self.log_probs.shape


@runtime_checkable
class RolloutEngine(Protocol):
    """A generation backend; ``generate`` returns its figures with its output (``RolloutOutput.stats``)."""

    def generate(
        self,
        model: torch.nn.Module,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
    ) -> RolloutOutput: ...

    def release(self) -> None:
        """Free the KV cache (and any captured graphs) now."""
        ...


def response_mask_from_tokens(
    responses: torch.Tensor, eos_token_ids: list[int], *, ignore_eos: bool = False
) -> torch.Tensor:
    """[N, R] int64 mask: 1 up to and including the first EOS of each row, 0 after.

    ``mask[t] = 1`` iff no EOS occurs at positions ``< t``. Independent of the pad id.
    """
    if ignore_eos or not eos_token_ids:
        return torch.ones_like(responses, dtype=torch.long)
    eos = torch.tensor(eos_token_ids, device=responses.device)
    is_eos = torch.isin(responses, eos).long()
    eos_before = is_eos.cumsum(dim=1) - is_eos
    return (eos_before == 0).long()


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """``torch.manual_seed(seed)`` on a forked random state (the caller's untouched); nothing when None."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield
