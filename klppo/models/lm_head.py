"""Float32 logits from a bf16/fp16 LM head, without a float32 copy of the weight.

A bf16 ``nn.Linear`` rounds every logit to bf16: at |logit| 16–32 one bf16 step is 0.125, so a token's
log-prob can move by up to 0.06 from rounding alone, and the rollout (which computes it once) and the
actor (which recomputes it) round differently. :func:`fp32_lm_head` makes the model's output projection
return float32 logits computed from the same bf16 operands: on CUDA one GEMM with a float32 output
(``torch.mm(..., out_dtype=torch.float32)``: bf16 inputs, float32 accumulation *and* result), elsewhere
an upcast matmul. The backward pass is the ordinary bf16 one (the float32 output gradient is rounded to
the weight dtype, as a bf16 layer's would be). Float32 models are untouched. The rollout engine's
``fp32_logits`` computes its logits the same way, so the two log-probs agree more closely
(``bench/logprob_precision.py``).
"""

from __future__ import annotations

import torch
from torch import nn


class _FP32Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        flat = x.reshape(-1, x.shape[-1])
        if flat.is_cuda:
            out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
        else:
            out = flat.float() @ weight.float().t()
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w


def fp32_logits_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as float32 from bf16/fp16 operands (see the module docstring); differentiable."""
    return _FP32Logits.apply(x, weight)


class FP32LogitsLinear(nn.Linear):
    """An ``nn.Linear`` (no bias) whose output is float32 when its input and weight are bf16/fp16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == x.dtype:
            return fp32_logits_linear(x, self.weight)
        return super().forward(x)


def fp32_lm_head(model: nn.Module) -> bool:
    """Make ``model``'s output embeddings return float32 logits (in place: same parameters, same state
    dict, tying kept). False when the head is not a bias-free ``nn.Linear`` (left as it is)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    head.__class__ = FP32LogitsLinear
    return True
