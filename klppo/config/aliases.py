"""Names users bring from verl and tuning guides, rewritten to one spelling before anything reads them.

Key aliases (`KEY_ALIASES`): a key that sets other keys. Value aliases (`normalize`): strategy `fsdp` →
`fsdp2` (`megatron` stays: the launch is translated to FSDP2 by `megatron.py`); KL estimator names `k1|k2|k3`
→ `kl|mse|low_var_kl` (a `+` suffix is kept); logger `file` →
`jsonl`; rollout engine `vllm|sglang|trtllm` → `klppo`; dtype long names → `fp32|bf16|fp16`; the deprecated
`optim.warmup_style` → `optim.lr_scheduler_type`. The printed configuration shows the normalized values.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from klppo.config._coerce import is_interpolation
from klppo.config.errors import ConfigError

KEY_ALIASES: dict[str, tuple[str, ...]] = {
    "reward_manager.name": ("reward_model.reward_manager",),
    "data.use_sequence_packing": (
        "actor_rollout_ref.model.use_remove_padding",
        "critic.model.use_remove_padding",
    ),
}

STRATEGY_KEYS = (
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.ref.strategy",
    "critic.strategy",
    "reward_model.strategy",
)
FSDP_CONFIG_KEYS = (
    "actor_rollout_ref.actor.fsdp_config",
    "actor_rollout_ref.ref.fsdp_config",
    "critic.model.fsdp_config",
    "reward_model.model.fsdp_config",
)
KL_NAME_KEYS = ("algorithm.kl_penalty", "actor_rollout_ref.actor.kl_loss_type")
KL_ALIASES = {"k1": "kl", "k2": "mse", "k3": "low_var_kl"}
KL_NAMES = ("kl", "abs", "mse", "low_var_kl", "full")
DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
}
LOGGERS = (
    "console",
    "jsonl",
    "tensorboard",
    "wandb",
    "mlflow",
    "swanlab",
    "clearml",
    "trackio",
    "vemlp_wandb",
)
ROLLOUT_ENGINES = ("klppo", "hf")

Notify = Callable[[str], None]


def get(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for name in key.split("."):
        node = node[name]
    return node


def put(tree: dict[str, Any], key: str, value: Any) -> None:
    *head, last = key.split(".")
    node = tree
    for name in head:
        node = node[name]
    node[last] = value


def choice_error(key: str, value: Any, valid: tuple[str, ...] | list[str]) -> ConfigError:
    near = difflib.get_close_matches(str(value), list(valid), n=1, cutoff=0.5)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return ConfigError(f"{key}={value!r}: expected one of {', '.join(valid)}{hint}")


def normalize(tree: dict[str, Any], notify: Notify) -> None:
    """Rewrite value aliases in the raw (unresolved) tree in place; interpolations are left alone."""
    for key in STRATEGY_KEYS + tuple(f"{k}.strategy" for k in FSDP_CONFIG_KEYS):
        _strategy(tree, key, notify)
    for key in KL_NAME_KEYS:
        _kl_name(tree, key, notify)
    _loggers(tree, notify)
    _rollout_name(tree, notify)
    for base in FSDP_CONFIG_KEYS:
        for sub in (
            "model_dtype",
            "dtype",
            "mixed_precision.param_dtype",
            "mixed_precision.reduce_dtype",
            "mixed_precision.buffer_dtype",
        ):
            _dtype(tree, f"{base}.{sub}")
    _dtype(tree, "actor_rollout_ref.rollout.dtype")
    _dtype(tree, "reward_model.rollout.dtype")
    for base in ("actor_rollout_ref.actor.optim", "critic.optim"):
        style = get(tree, f"{base}.warmup_style")
        if style is not None and not is_interpolation(style):
            notify(
                f"{base}.warmup_style={style} is read as {base}.lr_scheduler_type={style} (verl's newer name)"
            )
            put(tree, f"{base}.lr_scheduler_type", style)
            put(tree, f"{base}.warmup_style", None)


def _strategy(tree: dict[str, Any], key: str, notify: Notify) -> None:
    value = get(tree, key)
    if is_interpolation(value):
        return
    if value == "fsdp":
        put(tree, key, "fsdp2")
        if not key.endswith("fsdp_config.strategy"):
            notify(f"{key}=fsdp is read as fsdp2 (klppo shards with PyTorch FSDP2, fully_shard)")
    elif value not in ("fsdp2", "megatron"):  # megatron: a launch translated to FSDP2 (megatron.py)
        raise choice_error(key, value, ("fsdp2", "fsdp", "megatron"))


def _kl_name(tree: dict[str, Any], key: str, notify: Notify) -> None:
    value = get(tree, key)
    if is_interpolation(value):
        return
    base, plus = (value[:-1], "+") if value.endswith("+") else (value, "")
    if base in KL_ALIASES:
        new = KL_ALIASES[base] + plus
        notify(f"{key}={value} is read as {new}")
        put(tree, key, new)
        base = KL_ALIASES[base]
    if base not in KL_NAMES or (base == "full" and plus):
        valid = [*KL_NAMES, *(n + "+" for n in KL_NAMES if n != "full"), *KL_ALIASES]
        raise choice_error(key, value, valid)


def _loggers(tree: dict[str, Any], notify: Notify) -> None:
    key = "trainer.logger"
    out: list[str] = []
    for name in get(tree, key):
        if is_interpolation(name):
            out.append(name)
            continue
        if name == "file":
            notify("trainer.logger 'file' is read as 'jsonl' (metrics.jsonl in the run directory)")
            name = "jsonl"
        if name not in LOGGERS:
            raise choice_error(key, name, LOGGERS + ("file",))
        if name not in out:
            out.append(name)
    put(tree, key, out)


def _rollout_name(tree: dict[str, Any], notify: Notify) -> None:
    key = "actor_rollout_ref.rollout.name"
    value = get(tree, key)
    if is_interpolation(value):
        return
    if value in ("vllm", "sglang", "trtllm"):
        notify(
            f"{key}={value}: using klppo's own rollout engine (same sampling settings; {value} not needed)"
        )
        put(tree, key, "klppo")
    elif value not in ROLLOUT_ENGINES:
        raise choice_error(key, value, ROLLOUT_ENGINES + ("vllm", "sglang", "trtllm"))


def _dtype(tree: dict[str, Any], key: str) -> None:
    value = get(tree, key)
    if is_interpolation(value):
        return
    if str(value).lower() not in DTYPE_ALIASES:
        raise choice_error(key, value, ("fp32", "bf16", "fp16", "float32", "bfloat16", "float16"))
    put(tree, key, DTYPE_ALIASES[str(value).lower()])
