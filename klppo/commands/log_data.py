"""``klppo data log``: a file of logged responses (docs/data.md) from a model, with klppo's engine.

    klppo data log --output logs.parquet [--n 8] [--num-prompts N] [config.yaml] [dotted.key=value ...]

The configuration is `klppo train`'s (the same file and keys): the model (``actor_rollout_ref.model.path``),
the prompts (``data.train_files``, read in file order), the engine and its sampling
(``actor_rollout_ref.rollout.*``; ``--n`` replaces ``rollout.n``) and the reward (rule, user function or
reward model). Each prompt gets ``n`` samples, scored by the reward, with the per-token log-probs of the
distribution each token was drawn from (``log softmax(logits / temperature)``, or with top-k / top-p the
truncated, renormalised one: the engine's ``truncated_log_probs``) and the sampling settings
(``temperature``, ``top_p``, ``top_k``); the samples of one prompt share a ``group_id``. One process; the
weights in inference mode, no optimizer.

``--reference PATH`` also measures the KL of the model to a reference on these samples — KL(π‖π_ref) on the
model's own responses, the figure a KL target is meant to hold, which an offline run's controller does not
see (docs/data.md, "KL to the reference"): per response token, k3 = e^δ − δ − 1 and k1 = −δ with
δ = log π_ref − log π, both log-probs from one forward of each model at the sampling temperature (the full
softmax, as the trainer's KL; unclamped), printed as one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any

import torch

from klppo.assembly.data_check import tokenizer_trusts_code
from klppo.assembly.roles_build import build_reward, load_policy_model
from klppo.assembly.settings import engine_settings, loader_settings, sampling_params, to_dtype
from klppo.batch import Batch
from klppo.config import KLPPOConfig, load_config
from klppo.config.flags import FlagParser
from klppo.data.dataset import PromptLoader
from klppo.data.logged import tokenizer_fingerprint, write_logged
from klppo.models.loading import eos_token_ids, load_tokenizer, model_dir
from klppo.parallel import dist
from klppo.roles.forward import MicroBatching, no_grad_pass, policy_forward
from klppo.rollout.base import SamplingParams
from klppo.rollout.factory import make_rollout

log = logging.getLogger("klppo")


def _parser() -> argparse.ArgumentParser:
    p = FlagParser(
        prog="klppo data log", description="Sample a model's responses into a logged-responses file."
    )
    p.add_argument("--output", required=True, help="Parquet file to write (docs/data.md)")
    p.add_argument(
        "--n", type=int, default=None, help="samples per prompt (default: actor_rollout_ref.rollout.n)"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="the first N prompts (default: all)")
    p.add_argument(
        "--reference",
        default=None,
        help="also print the samples' KL to this model (a path as model.path takes): k3 and k1 per token",
    )
    return p


def sampling_for_log(cfg: KLPPOConfig, n: int | None) -> SamplingParams:
    """The rollout's training sampling (top-k / top-p included) with ``n`` samples per prompt."""
    params = sampling_params(
        cfg.actor_rollout_ref.rollout, response_length=cfg.data.max_response_length, validation=False
    )
    return dataclasses.replace(params, n=n or params.n)


def behaviour_log_probs(out: Any) -> torch.Tensor:
    """[B*n, R] the log-probs of the distribution each token was drawn from: the engine's truncated ones
    where top-k / top-p cut it, else its full softmax's."""
    return out.log_probs if out.truncated_log_probs is None else out.truncated_log_probs


def sample_rows(
    prompts: Batch, out: Any, scores: Any, params: SamplingParams, identity: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per sample (``n`` consecutive per prompt) in the schema of docs/data.md."""
    rows, log_probs = [], behaviour_log_probs(out)
    kept = None if out.truncated_log_probs is None else out.log_probs - out.truncated_log_probs
    for i in range(out.responses.shape[0]):
        p = i // params.n
        length = int(out.response_mask[i].sum())
        rows.append(
            {
                "data_source": prompts.data_source[p],
                "prompt": prompts.raw_prompt[p],
                "reward_model": {"ground_truth": prompts.ground_truth[p]},
                "extra_info": prompts.extra_info[p],
                "response_ids": out.responses[i, :length].tolist(),
                "response": scores.texts[i],
                "response_log_probs": log_probs[i, :length].float().tolist(),
                "response_log_kept_mass": None if kept is None else kept[i, :length].float().tolist(),
                "response_mask": [1] * length,
                "score": float(scores.sequence[i]),
                "group_id": str(prompts.uid[p]),
                "temperature": params.temperature if params.do_sample else 0.0,
                "top_p": params.top_p,
                "top_k": params.top_k,
                **identity,
            }
        )
    return rows


KL_TOKENS = 8192
"""Real tokens (prompt and response) of one forward when measuring the KL to the reference."""


def kl_sums(
    policy: torch.nn.Module, reference: torch.nn.Module, samples: Batch, temperature: float
) -> torch.Tensor:
    """[3] float64: the sums over ``samples``' response tokens of k3 and k1 (δ = log π_ref − log π, each from
    one forward at ``temperature``), and their count."""
    micro = MicroBatching(1, use_dynamic_bsz=True, max_token_len=KL_TOKENS)

    def log_probs(model: torch.nn.Module) -> torch.Tensor:
        def forward(mb: Batch) -> torch.Tensor:
            return policy_forward(model, mb, temperature=temperature, calculate_entropy=False)[0]

        return no_grad_pass(samples, micro, forward).double()

    delta = (log_probs(reference) - log_probs(policy))[samples.response_mask.bool()]
    return torch.stack([(delta.exp() - delta - 1).sum(), -delta.sum(), delta.new_tensor(delta.numel())]).cpu()


def _check_reference_vocabulary(name: str, path: str, model_path: str, trust_remote_code: bool) -> None:
    """Refuse, before any weights load, a reference whose vocabulary differs from the model's: the same
    token ids would name other tokens, and the KL would be meaningless."""
    from transformers import AutoConfig  # noqa: PLC0415  heavy: only with --reference

    theirs, vocab_size = (
        AutoConfig.from_pretrained(p, trust_remote_code=trust_remote_code).vocab_size
        for p in (path, model_path)
    )
    if theirs != vocab_size:
        raise ValueError(
            f"--reference {name}: a vocabulary of {theirs} tokens, the model's has {vocab_size}; the KL "
            "needs a reference with the model's tokenizer"
        )


def log_samples(
    cfg: KLPPOConfig,
    *,
    device: torch.device,
    output: str,
    n: int | None,
    num_prompts: int | None,
    reference: str | None = None,
) -> tuple[int, dict[str, float] | None]:
    """Write ``output`` from the model on ``device``; returns the number of samples and, with ``reference``,
    the samples' KL to it per response token (``k3``, ``k1``, ``tokens``)."""
    arr = cfg.actor_rollout_ref
    params = sampling_for_log(cfg, n)
    if reference and not params.do_sample:
        raise ValueError("--reference needs sampled responses: actor_rollout_ref.rollout.temperature is 0")
    model_path = model_dir(arr.model.path, key="actor_rollout_ref.model.path")
    tok_path = (
        model_dir(arr.model.tokenizer_path, key="actor_rollout_ref.model.tokenizer_path")
        if arr.model.tokenizer_path
        else model_path
    )
    tokenizer = load_tokenizer(tok_path, trust_remote_code=tokenizer_trusts_code(cfg))
    settings = loader_settings(cfg.data, seed=cfg.trainer.seed, validation=False)
    loader = PromptLoader(dataclasses.replace(settings, shuffle=False, drop_last=False), tokenizer)
    dtype = to_dtype(arr.rollout.dtype) if device.type == "cuda" else torch.float32
    ref_path = model_dir(reference, key="--reference") if reference else None
    if ref_path:
        _check_reference_vocabulary(reference, ref_path, model_path, arr.model.trust_remote_code)
    model = load_policy_model(arr.model, model_path, dtype, device, train=False).eval()
    ref_model = (
        load_policy_model(arr.model, ref_path, dtype, device, train=False).eval() if ref_path else None
    )
    kl = torch.zeros(3, dtype=torch.float64)
    eos = eos_token_ids(tokenizer, model.config, getattr(model, "generation_config", None))
    engine = make_rollout(
        arr.rollout.name,
        engine_settings(
            arr.rollout, tensor_parallel=False, eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id
        ),
    )
    reward = build_reward(cfg.reward_model, cfg.custom_reward_function, tokenizer, device)
    identity = {
        "model": arr.model.path,
        "tokenizer": tok_path,
        "tokenizer_hash": tokenizer_fingerprint(tokenizer),
    }
    rows: list[dict[str, Any]] = []
    for k, prompts in enumerate(loader):
        if num_prompts is not None and k * loader.batch_size >= num_prompts:
            break
        if num_prompts is not None:
            prompts = prompts.select(range(min(len(prompts), num_prompts - k * loader.batch_size)))
        prompts = prompts.to(device)
        seeded = dataclasses.replace(params, seed=cfg.trainer.seed * 1_000_003 + k)
        with torch.no_grad():
            out = engine.generate(model, prompts.prompts, prompts.prompt_mask, seeded)
        samples = prompts.repeat_interleave(params.n).replace(
            responses=out.responses,
            response_mask=out.response_mask.float(),
            rollout_log_probs=behaviour_log_probs(out),
        )
        rows += sample_rows(prompts, out, reward.score(samples), params, identity)
        if ref_model is not None:
            kl += kl_sums(model, ref_model, samples, params.temperature)
    reward.close()
    write_logged(output, rows)
    if ref_model is None:
        return len(rows), None
    tokens = max(float(kl[2]), 1.0)
    return len(rows), {"k3": float(kl[0]) / tokens, "k1": float(kl[1]) / tokens, "tokens": int(kl[2])}


def run(argv: list[str] | None = None) -> tuple[argparse.Namespace, int, dict[str, float] | None]:
    """``klppo data log`` without its error handling: the parsed flags, the samples written and, with
    ``--reference``, their KL to it (:func:`log_samples`)."""
    args, rest = _parser().parse_known_args(argv)
    cfg = load_config(rest)
    use_cuda = cfg.trainer.device != "cpu" and torch.cuda.is_available()
    # one process; the engine's rank-aware code needs a process group
    info = dist.init_distributed("cuda" if use_cuda else "cpu", 600.0)
    try:
        count, kl = log_samples(
            cfg,
            device=info.device,
            output=args.output,
            n=args.n,
            num_prompts=args.num_prompts,
            reference=args.reference,
        )
    finally:
        dist.destroy()
    return args, count, kl


def main(argv: list[str] | None = None) -> int:
    try:
        args, count, kl = run(argv)
    except (OSError, ValueError) as exc:
        print(f"klppo data log: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {count} logged samples to {args.output}")
    if kl is not None:
        print(
            f"KL to the reference {args.reference} on {kl['tokens']} response tokens: "
            f"k3 {kl['k3']:.4g}, k1 {kl['k1']:.4g} per token"
        )
    return 0
