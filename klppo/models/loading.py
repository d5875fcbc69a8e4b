"""Loading the models a PPO run needs: policy / reference (causal LM), critic, reward model, tokenizer.

Every loader takes a user path (`resolve_model_path`: local dir, `.gguf` file, or a cached hub id) and
returns a plain transformers `PreTrainedModel` on ``device`` in ``dtype``; sharding (FSDP2), mixed precision
and offload are applied later by `klppo.parallel`. A `.gguf` path is converted once to a cached bf16
directory (`klppo.models.gguf`) and then loaded from there, like any directory.

Critic = ``AutoModelForTokenClassification(num_labels=1)`` on the causal-LM checkpoint (as verl): the
backbone's weights load, the LM head is dropped, and the value head ``score`` (hidden → 1) is new. A new
head is initialised to **zero** (weight and bias), so V(s) = 0 for every token at step 0 — deterministic
whatever the RNG, and on the scale of returns early in training; the head gets gradients from the first
critic update and the backbone from the second. A head already present in the checkpoint (a klppo critic
export) is loaded, not reset.

Reward model = ``AutoModelForSequenceClassification(num_labels=1)``; a checkpoint without a trained head
is refused (its scores would be noise).
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from klppo.models.flops import model_flops_per_token, num_params
from klppo.models.gguf import convert_gguf_to_hf_dir, gguf_cache_path, quickstart_model_path
from klppo.models.paths import ModelLoadError, resolve_model_path
from klppo.models.tokenizer import eos_token_ids
from klppo.models.tokenizer import load_tokenizer as _load_tokenizer_from_dir

__all__ = [
    "ModelLoadError",
    "enable_activation_checkpointing",
    "eos_token_ids",
    "is_activation_checkpointing",
    "load_causal_lm",
    "load_critic",
    "load_reward_model",
    "load_tokenizer",
    "model_dir",
    "model_flops_per_token",
    "num_params",
    "quickstart_model_path",
    "resolve_model_path",
]


def model_dir(path: str, *, key: str | None = None) -> str:
    """`resolve_model_path`, then a `.gguf` file → its cached HF directory (converted on first use).
    ``key``: the config key that gave ``path``, put before the message of a path that does not resolve."""
    try:
        resolved = resolve_model_path(path)
    except ModelLoadError as exc:
        if key is None:
            raise
        raise ModelLoadError(f"{key}: {exc}") from None
    if Path(resolved).is_file():
        return convert_gguf_to_hf_dir(resolved)
    return resolved


def load_tokenizer(path: str, *, trust_remote_code: bool = False):
    """Tokenizer with EOS = end of a response and pad set (pad = EOS when missing); see `tokenizer`.

    A `.gguf` path uses its cached directory when it exists, else reads the tokenizer from the file
    (a few seconds) without converting the weights.
    """
    resolved = resolve_model_path(path)
    if Path(resolved).is_file():
        cached = gguf_cache_path(resolved)
        if (cached / "config.json").is_file():
            return _load_tokenizer_from_dir(str(cached), trust_remote_code=trust_remote_code)
        return _load_tokenizer_from_dir(
            str(Path(resolved).parent), trust_remote_code=trust_remote_code, gguf_file=Path(resolved).name
        )
    return _load_tokenizer_from_dir(resolved, trust_remote_code=trust_remote_code)


@contextmanager
def _quiet_transformers():
    """Silence 'weights newly initialized' notices: the callers below handle the head themselves."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415  heavy (transformers, ~2 s): only when a model loads

    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(previous)


def enable_activation_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer, across transformers versions."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def is_activation_checkpointing(model) -> bool:
    """Whether any module of ``model`` recomputes its activations in the backward pass."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _load(
    auto_class,
    path: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    trust_remote_code: bool,
    gradient_checkpointing: bool,
    attn_implementation: str | None,
    override_config: dict[str, Any] | None,
    config_kwargs: dict[str, Any] | None = None,
):
    """Shared body of the loaders: returns (model, missing_keys)."""
    from transformers import AutoConfig  # noqa: PLC0415  heavy (transformers, ~2 s): only when a model loads

    directory = model_dir(path)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    for key, value in {**(config_kwargs or {}), **(override_config or {})}.items():
        setattr(config, key, value)
    kwargs: dict[str, Any] = {"config": config, "dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        with _quiet_transformers(), default_dtype_change(dtype):
            model, info = auto_class.from_pretrained(directory, output_loading_info=True, **kwargs)
    except ValueError as error:
        if "Unrecognized configuration class" not in str(error):
            raise
        raise ModelLoadError(
            f"{path!r}: transformers has no {auto_class.__name__} for model type {config.model_type!r}, so "
            "klppo cannot build this role from it"
        ) from error
    model.to(device)
    if gradient_checkpointing:
        model.config.use_cache = False
        enable_activation_checkpointing(model)
    return model, set(info.get("missing_keys", ()))


DEFAULT_DTYPE_LOCK = threading.Lock()
"""Held while something may set the process-wide default dtype to another value (transformers does during
``from_pretrained(dtype=...)``) and by the rollout's background pre-compile while it compiles: dynamo
guards compiled graphs on the default dtype and refuses a change in the middle of a compilation."""


@contextmanager
def default_dtype_change(dtype: torch.dtype):
    """Around code that sets the default dtype to ``dtype`` for a while: takes ``DEFAULT_DTYPE_LOCK`` when
    that is a change (a background compile then waits, and this waits for its current function)."""
    if dtype == torch.get_default_dtype():
        yield
        return
    with DEFAULT_DTYPE_LOCK:
        yield


def load_causal_lm(
    path: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    override_config: dict[str, Any] | None = None,
):
    """The policy / reference model: ``AutoModelForCausalLM`` from ``path`` in ``dtype`` on ``device``.

    ``override_config`` entries are set on the config before the weights load (verl's
    ``model.override_config``). Gradient checkpointing uses the non-reentrant variant and turns the KV
    cache off in the config (generation passes ``use_cache=True`` explicitly).
    """
    from transformers import AutoModelForCausalLM  # noqa: PLC0415  heavy (transformers, ~2 s): only when a model is converted or loaded

    model, missing = _load(
        AutoModelForCausalLM,
        path,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        gradient_checkpointing=gradient_checkpointing,
        attn_implementation=attn_implementation,
        override_config=override_config,
    )
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if missing - tied:
        raise ModelLoadError(f"{path!r}: checkpoint lacks weights {sorted(missing - tied)[:5]}...")
    return model


def _head_names(model) -> set[str]:
    """Parameter names outside the backbone (``model.base_model_prefix``): the task head."""
    prefix = model.base_model_prefix + "."
    return {name for name, _ in model.named_parameters() if not name.startswith(prefix)}


def load_critic(
    path: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    override_config: dict[str, Any] | None = None,
):
    """Value model: token classification with one label on a causal-LM backbone; new head = zeros.

    ``model(input_ids, attention_mask).logits`` is [B, T, 1]: the value of each position's state.
    """
    from transformers import AutoModelForTokenClassification  # noqa: PLC0415  heavy (transformers, ~2 s): only when a model loads

    model, missing = _load(
        AutoModelForTokenClassification,
        path,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        gradient_checkpointing=gradient_checkpointing,
        attn_implementation=attn_implementation,
        override_config=override_config,
        config_kwargs={"num_labels": 1, "classifier_dropout": 0.0},
    )
    head = _head_names(model)
    if missing - head:
        raise ModelLoadError(f"{path!r}: checkpoint lacks backbone weights {sorted(missing - head)[:5]}...")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(missing & head):
            params[name].zero_()
    if missing & head:
        logging.getLogger(__name__).info("critic %s: new value head %s set to zero", path, sorted(missing))
    return model


def load_reward_model(
    path: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    override_config: dict[str, Any] | None = None,
    pad_token_id: int | None = None,
):
    """Reward model: ``AutoModelForSequenceClassification(num_labels=1)``; ``logits`` [B, 1] = score.

    The score is read at the last non-pad token, so the config needs ``pad_token_id``: the argument when
    given, else the checkpoint's, else the pad id of the tokenizer in the same directory. Raises
    `ModelLoadError` when the checkpoint has no trained head.
    """
    from transformers import AutoModelForSequenceClassification  # noqa: PLC0415  heavy (transformers, ~2 s): only when a model loads

    extra: dict[str, Any] = {"num_labels": 1}
    if pad_token_id is not None:
        extra["pad_token_id"] = pad_token_id
    model, missing = _load(
        AutoModelForSequenceClassification,
        path,
        dtype=dtype,
        device=device,
        trust_remote_code=trust_remote_code,
        gradient_checkpointing=False,
        attn_implementation=attn_implementation,
        override_config=override_config,
        config_kwargs=extra,
    )
    if model.config.pad_token_id is None:  # the score is read at the last non-pad token
        model.config.pad_token_id = load_tokenizer(
            model_dir(path), trust_remote_code=trust_remote_code
        ).pad_token_id
    if missing:
        raise ModelLoadError(
            f"{path!r} is not a trained reward model: weights {sorted(missing)[:5]} are missing (a causal-LM "
            "checkpoint has no score head). Pass a sequence-classification checkpoint."
        )
    model.eval()
    return model
