"""verl's Megatron launches read on FSDP2: each Megatron key becomes its FSDP2 counterpart, nothing, or a
refusal.

The mathematics a Megatron launch asks for (algorithm, losses, KL, batch sizes) is the FSDP one; what differs
is how the model is split over GPUs, which klppo decides with FSDP2, Ulysses and the rollout's own tensor
parallelism. `Translator` turns the Megatron entries of a launch (`<role>.megatron.*`, Megatron's optimizer
and LoRA keys, `*.strategy=megatron`, `--config-name=ppo_megatron_trainer`) into schema entries:

- a counterpart: `param_offload`/`grad_offload` → `fsdp_config.param_offload`, `optimizer_offload` (and
  `override_optimizer_config.optimizer_cpu_offload`) → `fsdp_config.optimizer_offload`,
  `context_parallel_size` → the role's `ulysses_sequence_parallel_size`, `dtype` →
  `mixed_precision.param_dtype`,
  `use_remove_padding` → `model.use_remove_padding`, LoRA rank/alpha/modules → `lora_rank`/`lora_alpha`/
  `target_modules`, `optim.optimizer=adam` → AdamW (Megatron's Adam decays weights decoupled),
  `optim.lr_decay_style=cosine` → `optim.lr_scheduler_type=cosine` (the same curve);
- nothing, where the key only chooses how the work is split or which kernel runs (tensor, pipeline,
  virtual-pipeline and expert sizes, sequence parallel, the distributed optimizer, fusions, recompute);
- a refusal by name, where it would change results (model-shape overrides, a precision with no FSDP2
  equivalent, Megatron's learning-rate schedules but constant and cosine, Megatron-format checkpoints).

`finish` prints ONE notice listing every Megatron key and what it became, and raises one ConfigError listing
every refused key. The translated layout's memory is checked before weights load
(`klppo.assembly.layout_checks.check_translated_memory`), the context-parallel size against the model's
heads (`check_ulysses_heads`). Knows nothing of models; reads no files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from klppo.config._coerce import is_interpolation
from klppo.config.errors import ConfigError

Notify = Callable[[str], None]
Item = tuple[str, Any, str]  # (dotted key, value, source)

CONFIG_NAMES = ("ppo_megatron_trainer", "_generated_ppo_megatron_trainer")
"""verl's packaged Megatron PPO configs: klppo's defaults with every strategy set to megatron."""


@dataclass(frozen=True)
class Role:
    """Where a Megatron role's counterparts live in klppo's schema (None: the role has no such key)."""

    fsdp: str
    ulysses: str
    model: str | None
    optim: str | None


ROLES: dict[str, Role] = {
    "actor_rollout_ref.actor": Role(
        "actor_rollout_ref.actor.fsdp_config",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.model",
        "actor_rollout_ref.actor.optim",
    ),
    "actor_rollout_ref.ref": Role(
        "actor_rollout_ref.ref.fsdp_config",
        "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        None,
        None,
    ),
    "critic": Role(
        "critic.model.fsdp_config", "critic.ulysses_sequence_parallel_size", "critic.model", "critic.optim"
    ),
    "reward_model": Role(
        "reward_model.model.fsdp_config", "reward_model.ulysses_sequence_parallel_size", None, None
    ),
}
STRATEGY_KEYS = tuple(f"{r}.strategy" for r in ROLES if r != "actor_rollout_ref.ref")

SPLIT = "how the work is split; FSDP2 shards every layer over all ranks"
CHECKPOINT_HOWTO = (
    "Megatron-format (dist_checkpointing) weights are not read: convert them to a Hugging Face folder "
    "(verl's `python -m verl.model_merger merge --backend megatron --local_dir <ckpt> --target_dir "
    "<hf_dir>`, "
    "or Megatron-Bridge's export) and set actor_rollout_ref.model.path to it"
)

# <role>.megatron.<name>: (counterpart field under the role's fsdp_config / "ulysses" / "padding" / None,
# note)
ENGINE: dict[str, tuple[str | None, str]] = {
    "param_offload": ("param_offload", "offload"),
    "grad_offload": ("param_offload", "FSDP2 offloads gradients with the parameter shards"),
    "optimizer_offload": ("optimizer_offload", "offload"),
    "context_parallel_size": ("ulysses", "context parallelism of the same size, as Ulysses"),
    "dtype": ("mixed_precision.param_dtype", "compute dtype"),
    "use_remove_padding": ("padding", "packed sequences"),
    "tensor_model_parallel_size": (None, SPLIT + "; the rollout's own is rollout.tensor_model_parallel_size"),
    "pipeline_model_parallel_size": (None, SPLIT + ", no pipeline stages"),
    "virtual_pipeline_model_parallel_size": (None, SPLIT + ", no pipeline stages"),
    "expert_model_parallel_size": (None, SPLIT + ", experts included"),
    "expert_tensor_parallel_size": (None, SPLIT + ", experts included"),
    "sequence_parallel": (None, "Megatron's activation split inside tensor parallelism"),
    "use_distributed_optimizer": (None, "FSDP2 always shards the optimizer state"),
    "use_mbridge": (None, "weights load from the Hugging Face folder directly"),
    "vanilla_mbridge": (None, "weights load from the Hugging Face folder directly"),
    "seed": (None, "seeds come from trainer.seed"),
    "forward_only": (None, "set by the role"),
    "dist_checkpointing_path": (None, "read only with use_dist_checkpointing"),
    "dist_checkpointing_prefix": (None, "read only with use_dist_checkpointing"),
    "use_dist_checkpointing": (None, "Hugging Face weights are read"),
}

# override_transformer_config entries: inert (speed or memory only) or refused (the model or its numbers)
INERT_TRANSFORMER = {
    **dict.fromkeys(
        ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"),
        "activation recompute (memory only): model.enable_gradient_checkpointing decides",
    ),
    **dict.fromkeys(
        (
            "attention_backend",
            "apply_rope_fusion",
            "masked_softmax_fusion",
            "bias_activation_fusion",
            "bias_dropout_fusion",
            "gradient_accumulation_fusion",
            "persist_layer_norm",
            "cross_entropy_loss_fusion",
            "moe_grouped_gemm",
            "moe_permute_fusion",
        ),
        "kernel or fusion choice",
    ),
    **dict.fromkeys(
        (
            "deallocate_pipeline_outputs",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
            "num_layers_in_first_pipeline_stage",
            "num_layers_in_last_pipeline_stage",
            "pipeline_model_parallel_layout",
        ),
        "pipeline layout (no pipeline stages)",
    ),
    **dict.fromkeys(
        (
            "moe_token_dispatcher_type",
            "moe_enable_deepep",
            "moe_shared_expert_overlap",
            "overlap_moe_expert_parallel_comm",
            "tp_comm_overlap",
            "cp_comm_type",
        ),
        "communication scheme",
    ),
}
REFUSED_TRANSFORMER = {
    "moe_router_dtype": "the router runs in the compute dtype under FSDP2 mixed precision (no fp32 router)",
    "fp8": "fp8 training is not built",
    "fp8_recipe": "fp8 training is not built",
    "calculate_per_token_loss": "the loss weighting is klppo's (actor.loss_agg_mode)",
}
ZERO_ONLY_TRANSFORMER = ("hidden_dropout", "attention_dropout")  # accepted at 0 (no dropout, as in PPO)

# Megatron's optimizer keys under <role>.optim: value accepted as is → note (anything else is refused)
OPTIM_ACCEPTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "lr_decay_style": (("constant",), "lr_scheduler_type=constant"),
    "lr_warmup_init": ((0, 0.0), "warmup starts from 0"),
    "weight_decay_incr_style": (("constant",), "constant weight decay"),
    "min_lr": ((0, 0.0), "no floor, as optim.min_lr_ratio=0"),
    "lr_decay_steps": ((None,), "the schedule spans the run"),
    "lr_wsd_decay_style": ((), "read only with lr_decay_style=WSD"),
    "lr_wsd_decay_steps": ((), "read only with lr_decay_style=WSD"),
    "use_checkpoint_opt_param_scheduler": ((), "the scheduler resumes from klppo's checkpoint"),
}
COSINE_NOTE = (
    "the same curve: after the warmup lr·½(1 + cos(π·progress)), progress over the run's steps (Megatron's "
    "lr_decay_steps null), down to min_lr 0"
)
# other Megatron-only keys (`<role>.nccl_timeout`, `rollout.layer_name_map.*`) → what the notice says they
# become
OTHER_NOTES = {
    "nccl_timeout": "trainer.collective_timeout_s bounds every collective",
    "layer_name_map": "the rollout reads the actor's gathered weights by their Hugging Face names; "
    "no Megatron "
    "layer names to map",
}
OPTIM_OVERRIDES = {
    "optimizer_cpu_offload": "optimizer_offload",
    "optimizer_offload_fraction": None,
    "overlap_cpu_optimizer_d2h_h2d": None,
    "use_precision_aware_optimizer": None,
}
LORA_MODULES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
LORA_DEFAULTS = {
    "type": "lora",
    "dropout": 0.0,
    "dtype": None,
    "adapter_path": None,
    "exclude_modules": [],
    "lora_B_init_method": "zero",
}
LORA_INERT = (
    "merge",
    "a2a_experimental",
    "dropout_position",
    "freeze_vision_model",
    "freeze_vision_projection",
    "freeze_language_model",
)


def is_megatron_key(key: str) -> bool:
    """A key only Megatron's configs have: `<role>.megatron.*`, `<role>.load_weight`, Megatron's LoRA group,
    optimizer keys and `override_optimizer_config` entries, the rollout's `layer_name_map`."""
    parts = key.split(".")
    if "megatron" in parts or "layer_name_map" in parts:
        return True
    role = _role_of(key)
    rest = key[len(role) + 1 :].split(".") if role else []
    if rest == ["load_weight"] or (rest == ["nccl_timeout"] and role in ("critic", "reward_model")):
        return True
    if len(rest) >= 2 and rest[0] == "optim":
        return rest[1] in OPTIM_ACCEPTED or (
            rest[1] == "override_optimizer_config" and len(rest) == 3 and rest[2] in OPTIM_OVERRIDES
        )
    return (
        len(parts) >= 3
        and parts[-2] == "lora"
        and ".".join(parts[:-2]) in ("actor_rollout_ref.model", "critic.model")
    )


def _role_of(key: str) -> str | None:
    for role in ROLES:
        if key == role or key.startswith(role + "."):
            return role
    if key.startswith("critic.model."):
        return "critic"
    return None


@dataclass
class Translator:
    """Collects the translation of one launch: `items` rewrites entries, `finish` reports."""

    lines: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    megatron: bool = False
    lora_ranks: dict[str, int] = field(default_factory=dict)  # model key → Megatron's lora.rank
    lora_refused: dict[str, list[str]] = field(default_factory=dict)  # model key → refusals if rank > 0

    def config_name(self, name: str, where: str) -> list[Item]:
        """verl's packaged Megatron config (`--config-name` or a `defaults:` entry): klppo's defaults with
        every role's strategy megatron."""
        self.megatron = True
        self.lines.append(f"{where} → klppo's defaults, each role's strategy megatron")
        return [(k, "megatron", where) for k in STRATEGY_KEYS]

    def scan(self, keys_values: list[tuple[str, Any]]) -> None:
        """Mark the launch Megatron when any entry is (read before any is translated)."""
        self.megatron |= any(
            is_megatron_key(k) or (k.endswith(".strategy") and v == "megatron") for k, v in keys_values
        )

    def touches(self, key: str, value: Any) -> bool:
        """Whether `items` rewrites this entry."""
        return (
            is_megatron_key(key)
            or (key.endswith(".strategy") and value == "megatron")
            or (
                key.endswith(".optim.override_optimizer_config")
                and isinstance(value, dict)
                and bool(set(value) & set(OPTIM_OVERRIDES))
            )
            or (self.megatron and key.endswith(".optim.optimizer") and str(value).lower() == "adam")
            or (
                key.endswith("model.override_config")
                and isinstance(value, dict)
                and bool(set(value) & {"model_config", "moe_config"})
            )
        )

    def items(self, items: list[Item]) -> list[Item]:
        """`items` with each Megatron entry replaced by its counterparts (placed after the others, so that a
        Megatron key wins over the file's own FSDP-side default of the same setting)."""
        kept, translated = [], []
        for key, value, source in items:
            if not self.touches(key, value):
                kept.append((key, value, source))
            elif key.endswith(".optim.override_optimizer_config"):
                ours = {k: v for k, v in value.items() if k not in OPTIM_OVERRIDES}
                for k in [k for k in value if k in OPTIM_OVERRIDES]:
                    self.megatron = True
                    translated += self._one(f"{key}.{k}", value[k], source)
                kept.append((key, ours or None, source))
            elif key.endswith("model.override_config"):
                ours = {k: v for k, v in value.items() if k not in ("model_config", "moe_config")}
                ours.update(value.get("model_config") or {})
                freeze = (value.get("moe_config") or {}).get("freeze_moe_router", False)
                if freeze:
                    self._refuse(
                        f"{key}.moe_config.freeze_moe_router", freeze, "a frozen MoE router is not built"
                    )
                self.lines.append(
                    f"{key}.model_config → {key} (its entries: {_short(value.get('model_config'))})"
                )
                kept.append((key, ours, source))
            elif key.endswith(".optim.optimizer"):
                self.lines.append(f"{key}=adam → AdamW (Megatron's Adam decays weights decoupled)")
                translated.append((key, "AdamW", source))
            else:
                self.megatron = True
                translated += self._one(key, value, source)
        return kept + translated

    def deleted(self, key: str) -> None:
        self.lines.append(f"~{key} → nothing (klppo's defaults stand)")

    def finish(self, notify: Notify) -> None:
        """One notice with every line; one ConfigError naming every refused key."""
        for model, refused in self.lora_refused.items():
            if self.lora_ranks.get(model, 0) > 0:
                self.refused += refused
            else:
                self.lines += [f"{r.split(':')[0]} → nothing (LoRA is off: rank 0)" for r in refused]
        if self.refused:
            raise ConfigError(
                "klppo train cannot honour these Megatron settings (they would change results):\n  - "
                + "\n  - ".join(self.refused)
            )
        if self.lines:
            notify(
                "Megatron launch read on FSDP2 (docs/verl_compat.md#megatron-launches):\n  "
                + "\n  ".join(self.lines)
            )

    # one entry ------------------------------------------------------------------------------------------

    def _one(self, key: str, value: Any, source: str) -> list[Item]:
        if isinstance(value, dict) and value:
            return [
                i for k, v in value.items() if k != "_target_" for i in self._one(f"{key}.{k}", v, source)
            ]
        if key.endswith(".strategy"):
            self.lines.append(f"{key}=megatron → FSDP2 (the translation below)")
            return [(key, value, source)]
        role = _role_of(key)
        parts = key.split(".")
        if "megatron" in parts and role in ROLES:
            return self._engine(ROLES[role], key, parts[parts.index("megatron") + 1 :], value, source)
        if ".optim." in key and role in ROLES and ROLES[role].optim:
            return self._optim(ROLES[role], key, parts[-1], value, source)
        if parts[-2:-1] == ["lora"]:
            return self._lora(".".join(parts[:-2]), key, parts[-1], value, source)
        if parts[-1] == "load_weight" and value is False:
            self._refuse(key, value, "klppo always loads the model's weights")
            return []
        return self._nothing(
            key,
            value,
            OTHER_NOTES.get(parts[-2] if "layer_name_map" in parts else parts[-1], "Megatron-only setting"),
        )

    def _engine(self, role: Role, key: str, rest: list[str], value: Any, source: str) -> list[Item]:
        name = rest[0] if rest else ""
        if is_interpolation(value):
            followed = _followed_actor_key(value)
            if followed is None or len(rest) != 1 or ENGINE.get(name, (None,))[0] in (None, "padding"):
                return self._nothing(key, value, "follows another Megatron key: klppo's default stands")
            actor = self._engine(ROLES["actor_rollout_ref.actor"], followed[0], [name], followed[1], source)
            self.lines.pop()  # the actor's own line is not this key's
            if not actor:
                return self._nothing(key, value, "follows the actor's, which translates to nothing")
            value = "${oc.select:" + actor[0][0] + "," + followed[1] + "}"
        if name == "override_transformer_config" and len(rest) == 2:
            return self._transformer(key, rest[1], value)
        if name in ("override_transformer_config", "override_ddp_config") and value in ({}, None):
            return self._nothing(key, value, "no entries")
        if name == "override_ddp_config":
            return self._nothing(
                key, value, "gradient reduction scheme (FSDP2 reduce-scatters in reduce_dtype)"
            )
        if name == "override_mcore_model_config":
            self._refuse(
                key,
                value,
                "changes the model Megatron builds; klppo builds the model of config.json "
                "(actor_rollout_ref.model.override_config sets its keys)",
            )
            return []
        if name == "use_dist_checkpointing" and value:
            self._refuse(key, value, CHECKPOINT_HOWTO)
            return []
        if name not in ENGINE:
            self._refuse(key, value, "a Megatron setting klppo has not classified (it may change results)")
            return []
        target, note = ENGINE[name]
        if target is None or (name == "grad_offload" and not value):
            return self._nothing(key, value, note)
        if target == "ulysses":
            dest = role.ulysses
        elif target == "padding":
            if role.model is None:
                return self._nothing(key, value, "follows the model's use_remove_padding")
            dest = f"{role.model}.use_remove_padding"
        elif role.optim is None and target == "optimizer_offload":
            return self._nothing(key, value, "this role has no optimizer")
        else:
            dest = f"{role.fsdp}.{target}"
        self.lines.append(f"{key}={value!r} → {dest}={value!r} ({note})")
        return [(dest, value, source)]

    def _transformer(self, key: str, name: str, value: Any) -> list[Item]:
        if name in INERT_TRANSFORMER:
            return self._nothing(key, value, INERT_TRANSFORMER[name])
        if name in ZERO_ONLY_TRANSFORMER and value in (0, 0.0):
            return self._nothing(key, value, "no dropout, as klppo trains")
        reason = REFUSED_TRANSFORMER.get(
            name, "changes the model's shape or numbers (not a kernel or split choice)"
        )
        self._refuse(key, value, reason)
        return []

    def _optim(self, role: Role, key: str, name: str, value: Any, source: str) -> list[Item]:
        if name in OPTIM_OVERRIDES:
            target = OPTIM_OVERRIDES[name]
            if target is None or not value:
                return self._nothing(key, value, "how the offloaded optimizer step runs")
            dest = f"{role.fsdp}.{target}"
            self.lines.append(f"{key}={value!r} → {dest}={value!r} (offload)")
            return [(dest, value, source)]
        accepted, note = OPTIM_ACCEPTED[name]
        if name == "lr_decay_style" and str(value).lower() == "cosine":
            dest = f"{role.optim}.lr_scheduler_type"
            self.lines.append(f"{key}={value!r} → {dest}='cosine' ({COSINE_NOTE})")
            return [(dest, "cosine", source)]
        if accepted and value not in accepted:
            self._refuse(
                key,
                value,
                f"Megatron's schedule option; klppo's {role.optim}.lr_scheduler_type "
                "(constant|cosine), lr_warmup_steps and min_lr_ratio set the schedule",
            )
            return []
        return self._nothing(key, value, note)

    def _lora(self, model: str, key: str, name: str, value: Any, source: str) -> list[Item]:
        if name == "rank":
            self.lora_ranks[model] = int(value or 0)
            self.lines.append(f"{key}={value!r} → {model}.lora_rank={value!r}")
            return [(f"{model}.lora_rank", value, source)]
        if name == "alpha":
            self.lines.append(f"{key}={value!r} → {model}.lora_alpha={value!r}")
            return [(f"{model}.lora_alpha", value, source)]
        if name == "target_modules":
            names = [value] if isinstance(value, str) else list(value or [])
            if set(names) == set(LORA_MODULES):
                self.lines.append(f"{key}={value!r} → {model}.target_modules=all-linear")
                return [(f"{model}.target_modules", "all-linear", source)]
            if all(n in LORA_MODULES for n in names):
                mapped = [m for n in names for m in LORA_MODULES[n]]
                self.lines.append(f"{key}={value!r} → {model}.target_modules={mapped}")
                return [(f"{model}.target_modules", mapped, source)]
            self._refuse_with_lora(
                model, key, value, f"the Megatron modules klppo maps are {', '.join(LORA_MODULES)}"
            )
            return []
        if name == "lora_A_init_method":
            if value == "kaiming":
                return self._nothing(key, value, "peft's Kaiming-uniform init of A")
            self._refuse_with_lora(model, key, value, "peft initialises A Kaiming-uniform (set kaiming)")
            return []
        if name in LORA_INERT:
            return self._nothing(key, value, "rollouts merge the adapters into the gathered weights")
        if name in LORA_DEFAULTS and value != LORA_DEFAULTS[name]:
            self._refuse_with_lora(model, key, value, "klppo's LoRA (peft) has no such option")
            return []
        return self._nothing(key, value, "peft's LoRA")

    def _nothing(self, key: str, value: Any, note: str) -> list[Item]:
        self.lines.append(f"{key}={_short(value)} → nothing ({note})")
        return []

    def _refuse_with_lora(self, model: str, key: str, value: Any, reason: str) -> None:
        self.lora_refused.setdefault(model, []).append(f"{key}={_short(value)}: {reason}")

    def _refuse(self, key: str, value: Any, reason: str) -> None:
        self.refused.append(f"{key}={_short(value)}: {reason}")


def _followed_actor_key(value: str) -> tuple[str, str] | None:
    """(actor's Megatron key, fallback) of verl's
    `${oc.select:actor_rollout_ref.actor.megatron.X,fallback}`."""
    prefix = "${oc.select:actor_rollout_ref.actor.megatron."
    if not (value.startswith(prefix) and value.endswith("}") and "," in value):
        return None
    key, fallback = value[len("${oc.select:") : -1].split(",", 1)
    return key, fallback


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
