"""Generates `docs/configuration.md` and `klppo/config/ppo_trainer.yaml` from the schema.

python -m klppo.config.docgen      # rewrites both files (tests check they are current)
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from omegaconf import OmegaConf

from klppo.config._walk import hints, is_group, type_name
from klppo.config.aliases import KEY_ALIASES
from klppo.config.schema import KLPPOConfig
from klppo.config.unimplemented import UNIMPLEMENTED

ROOT = Path(__file__).resolve().parents[2]
_EFFECT = {
    "warn": "accepted, no effect yet (one warning at start)",
    "refuse": "`klppo train` refuses (would change results); `klppo config` accepts",
    "notice": "runs, with a notice (speed/memory only)",
}

HEADER = """# Configuration

klppo reads verl's configuration: the key names and groups of verl's `ppo_trainer.yaml` (v0.7), with
verl's defaults except where noted below. A verl command runs by swapping the module name:

```
klppo config [file.yaml] [key=value ...]     # print the resolved configuration as YAML, exit 0 (2 on error)
klppo train  [file.yaml] [key=value ...]     # the same arguments; no arguments: the quickstart
python -m klppo.trainer.main_ppo [file.yaml] [key=value ...]
```

Layers, later wins: schema defaults (written out, for reading only, as `klppo/config/ppo_trainer.yaml`;
not read at load), the YAML file (first
argument; hydra's `--config-path DIR --config-name NAME` also works; its `defaults:` list and verl's
`_target_` keys are ignored), then `key=value` overrides in order.

verl's command-line conventions (hydra's) are read as verl reads them (`klppo/config/hydra.py`):
`+key=v` / `++key=v` set a key, and for a key klppo lacks they are accepted with one note naming it (a
plain `key=v` for an unknown key stays an error); a YAML with a hydra `defaults:` list likewise adds keys
(unknown ones noted and ignored), a plain YAML may not; `~key` puts a key back to its default; `???` leaves
the default. `--config-name` of verl's packaged `ppo_trainer` / `_generated_ppo_trainer` (absent at the
given path) means klppo's defaults; the Megatron configs and a Megatron `defaults:` entry mean klppo's
defaults with each role's `strategy: megatron`, and every `*.megatron.*` key is translated to its FSDP2
counterpart, to nothing, or refused by name, in one notice (verl_compat.md, "Megatron launches"). `null` is accepted where verl
takes it (`custom_reward_function.name` without a path, `optim.lr_warmup_steps`, `algorithm.kl_ctrl.target_kl`
with the fixed controller), and `trainer.test_freq` / `save_freq` take booleans as verl's code reads them
(false = never, true = every step).
Values follow YAML: lists `[a,b]`, booleans `True/true/false`, `null`; numbers are typed by the key, so
`1e8` into an integer key is `100000000`. A mapping-valued key (e.g. `reward_model.reward_kwargs`) set from
a file replaces the default mapping; `key.sub=value` sets one entry. `${...}` interpolations (verl's
`${oc.select:...}` included) are resolved once: a key shown as "follows X" takes X's value unless set.
Python code uses `klppo.config.load_config(argv)`, which returns a frozen, typed tree with these names.

## Errors

Everything is checked before any model loads, with the key, the value and what was expected:
unknown keys (with the closest valid keys), wrong types, values outside their range or choices, and the
batch-size rules below. `klppo config` judges the configuration alone, for `trainer.n_gpus_per_node ×
trainer.nnodes` ranks when n_gpus_per_node is a number (1 when `auto`); what depends on the machine is
checked when `klppo train` starts.

## Units and batch sizes (the most common verl confusion)

| key | counts | per |
| --- | --- | --- |
| `data.train_batch_size` | PROMPTS | training step, all GPUs (samples per step = × `rollout.n`) |
| `actor_rollout_ref.actor.ppo_mini_batch_size`, `critic.ppo_mini_batch_size` | PROMPTS | optimizer step, all GPUs (× `rollout.n` samples) |
| `*.ppo_micro_batch_size_per_gpu`, `*.log_prob_micro_batch_size_per_gpu`, `critic.forward_micro_batch_size_per_gpu` | SAMPLES | one forward(/backward) on one GPU |
| `*.ppo_micro_batch_size`, `*.log_prob_micro_batch_size` (deprecated) | SAMPLES | all GPUs (divided by the data-parallel size) |
| `*_max_token_len_per_gpu` (with `use_dynamic_bsz`) | TOKENS (prompt + response) | one micro-batch on one GPU |

Rules (`klppo.config.derive_sizes(cfg, world_size)` computes every per-rank size in one place):
`ppo_mini_batch_size ≤ train_batch_size` and divides it; `train_batch_size` divisible by the number of
ranks (each rank generates for its share of prompts, keeping a prompt's n samples together);
`ppo_mini_batch_size × n` divisible by the data-parallel size (ranks / `ulysses_sequence_parallel_size`);
the per-GPU share of a mini-batch divisible by `ppo_micro_batch_size_per_gpu`; with `use_dynamic_bsz`,
each token budget (× Ulysses size) must hold `max_prompt_length + max_response_length`. klppo differs from
verl in one forgiving way: an unset micro-batch size (without `use_dynamic_bsz`) means one pass over the
GPU's whole mini-batch share, and unset log-prob micro-batch sizes follow the actor's. GRPO/RLOO with
`rollout.n=1` warns (every advantage would be 0).

## Keys klppo adds

| key | default | meaning |
| --- | --- | --- |
| `data.bad_row_policy` | `skip` | a row with a missing/wrong-typed/empty prompt: `skip` (reported with file and row, counted) or `error` (stop) |
| `trainer.seed` | `1` | seed of model initialization (value head), sampling and, when `data.seed` is null, data order |
| `trainer.max_nan_steps` | `3` | a step with a NaN/inf reward, log-prob, KL, advantage, loss or gradient is skipped (no model updated) and counted; past this many (in all) the run stops |
| `trainer.collective_timeout_s` | `1800` | seconds a collective may wait before the run fails with the phase named |
| `trainer.gpu_memory_gib` | `80.0` | GPU size the memory check of a Megatron launch assumes when no GPU is visible (`docs/verl_compat.md#megatron-launches`) |
| `monitor.*` | see `docs/training.md` | operating rules that act on each step's metrics: early stops (KL over target, reward plateau), validation-drop rollback, out-of-memory retry, KL explosion, entropy collapse, NaN reward, drift warnings |
| `trainer.stop_grace_s` | `600` | on SIGTERM/SIGINT, `klppo train` tells its ranks to finish the step and save, and waits this long for them before stopping them (then torchrun's 30 s, then SIGKILL) |
| `reward_model.reward_kwargs` | `{}` | passed to the scorer, e.g. `{method: flexible, format_score: 0.1}` for GSM8K |
| `*.fsdp_config.mixed_precision.{param,reduce,buffer}_dtype` | `bf16`, `fp32`, `fp32` | FSDP2 mixed precision on GPU (CPU computes in fp32) |
| `*.fsdp_config.backward_prefetch` | `true` | prefetch the previous unit's all-gather during backward |
| `*.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap` | `null` | classes made one unit each at `min_num_params=0` (null: the model's `_no_split_modules`) |

| `actor_rollout_ref.actor.kl_loss_ctrl.*` | `type: fixed` | controller of the KL-loss β (`fixed`, `adaptive`, `pi`), with `kl_loss_coef` as the initial β; reads the token mean of `kl_loss_type`(π_old‖π_ref) over the step's batch (metric `actor/kl_loss_ctrl_kl`) after the step's update and sets the next step's β |
| `algorithm.kl_ctrl.{kp,ki,min_coef,max_coef}` | `1.0, 0.2, 1e-4, 10` | gains and bounds of `type: pi` (also for `kl_loss_ctrl`); formulas in docs/algorithms.md |

`data.seed` (verl's) is the shuffle seed; null uses `trainer.seed`.

**Scale of the reward-side adaptive controller** (`algorithm.kl_ctrl.type=adaptive`, verl's rule): the KL
it compares with `target_kl` is the batch mean of each response's *per-token mean* KL (`algorithm.kl_penalty`
estimator, π_old against π_ref), while the penalty itself is β·KL on *every* response token, so a response of
L tokens loses ≈ β·L·KL of reward. `horizon` is counted in *samples*: each step multiplies β by up to
1 + 0.2·(samples in the step)/horizon — with 256 samples per step and horizon 2000, ×1.026 per step, ×3.6
in 50 steps. When β·L·KL grows past the task score, the policy is pulled back toward the reference instead
of learning: the metric `actor/reward_kl_penalty_share` (mean |β·Σ_t KL| ÷ mean |Σ_t score|) shows it, and
the console warns after 5 steps above 1. `type: pi` acts per step (no horizon), but its log error is clipped to ±1, so
past the proportional term (at most ±kp) ln β moves by at most `ki` per step: started while the KL is ≈ 0 it drives β down
to `min_coef` first, and with gentle gains (kp 0.3, ki 0.05) climbing back from a floor of 0.001 takes ≈ ln(80)/0.05 ≈ 90
steps to reach 0.08 once the policy moves, while the KL runs far over its target. Set `min_coef`
close to the starting `kl_coef` (a floor that still penalises the first switch) or use the default gains.
With a group estimator that divides by the group's std (`grpo`, `grpo_passk` with
`norm_adv_by_std_in_grpo=True`) the reward-side penalty becomes a unit-size advantage in every group whose
task scores are equal, whatever β: klppo notes it at load time; put the KL in the loss there instead.

## Defaults that differ from verl

| key | klppo | verl | why |
| --- | --- | --- | --- |
| `trainer.device` | `auto` | `cuda` | cuda when present, else cpu |
| `trainer.n_gpus_per_node` | `auto` | `8` | all visible GPUs; 1 process on CPU unless set |
| `trainer.logger` | `[console, jsonl]` | `[console, wandb]` | no account needed |
| `actor_rollout_ref.rollout.name` | `klppo` | required | our engine; `hf` = transformers generate |
| `actor_rollout_ref.rollout.tensor_model_parallel_size` | `1` | `2` | a model that fits one GPU generates fastest data-parallel; 2+ for models that do not |
| `*.strategy` | `fsdp2` | `fsdp` | the same thing here (see aliases) |
| `critic.model.path` | follows the actor's model | a fixed path | the usual choice |
| `actor_rollout_ref.ref.fsdp_config.model_dtype` | `bf16` | `fp32` (v0.7 YAML); bf16 when the key is absent (older verl) | the frozen reference only runs forward in bf16 anyway |
| dtypes | `fp32`/`bf16`/`fp16` | also `float32`/`bfloat16` | long names accepted, printed short |
| `data.return_raw_chat` | `false` | `true` in v0.7 | v0.6 value: prompts are templated token ids |

## Aliases (printed normalized, with a note on stderr)

| written | read as |
| --- | --- |
{key_aliases}| `strategy: fsdp` (any role) | `fsdp2` (PyTorch FSDP2); `megatron` runs on FSDP2, its keys translated (verl_compat.md) |
| `kl_penalty` / `kl_loss_type`: `k1`, `k2`, `k3` (optionally with `+`) | `kl`, `mse`, `low_var_kl` (the `+` kept: value of the estimator, gradient of k2) |
| `trainer.logger: file` | `jsonl` |
| `actor_rollout_ref.rollout.name: vllm`, `sglang` or `trtllm` | `klppo` (same sampling keys; nothing to install) |
| `*.optim.warmup_style` (deprecated in verl) | `*.optim.lr_scheduler_type` |
| dtype `float32`/`bfloat16`/`float16` | `fp32`/`bf16`/`fp16` |

## Keys accepted, no effect yet (and keys train refuses)

These verl keys are accepted so that verl command lines run unchanged. Nothing happens while they keep their
default; set to another value, they act as the second column says. Every other key is implemented.
This is the one list (`klppo/config/unimplemented.py`).

| key | when set to a non-default value | why |
| --- | --- | --- |
{unimplemented}
## All keys

A meaning ends with a link where a guide explains the key at more length.
"""


def _default_text(value: object) -> str:
    if isinstance(value, str):
        m = re.fullmatch(r"\$\{oc\.select:([^,]+),(.*)\}", value) or re.fullmatch(r"\$\{([^}]+)\}", value)
        if m:
            return f"follows `{m.group(1)}`"
    text = json.dumps(value) if not isinstance(value, str) else value
    return f"`{text}`".replace("|", "\\|")


def _meaning(f: dataclasses.Field) -> str:
    """A field's help, then `See [guide.md](guide.md#section).` where the schema names the guide section that
    explains the key."""
    see = f.metadata.get("see", "")
    return f.metadata.get("help", "") + (f" See [{see.split('#')[0]}]({see})." if see else "")


def _rows(cls: type, obj: object, prefix: str) -> list[str]:
    rows = []
    for f in dataclasses.fields(cls):
        tp, key, value = hints(cls)[f.name], prefix + f.name, getattr(obj, f.name)
        meaning = _meaning(f).replace("|", "\\|")
        if is_group(tp):
            rows.append(f"| **`{key}`** | | {meaning} |")
            rows += _rows(tp, value, key + ".")
        else:
            kind = type_name(tp).replace("|", "/")
            rows.append(f"| `{key}` | {_default_text(value)} | {meaning} ({kind}) |")
    return rows


def render_docs() -> str:
    key_aliases = "".join(f"| `{k}` | {', '.join(f'`{t}`' for t in ts)} |\n" for k, ts in KEY_ALIASES.items())
    unimpl = "".join(f"| `{p}` | {_EFFECT[e]} | {r} |\n" for p, e, r in UNIMPLEMENTED)
    text = HEADER.replace("{key_aliases}", key_aliases).replace("{unimplemented}", unimpl)
    cfg = KLPPOConfig()
    for f in dataclasses.fields(KLPPOConfig):
        tp = hints(KLPPOConfig)[f.name]
        text += f"\n### `{f.name}`: {_meaning(f)}\n\n| key | default | meaning (type) |\n"
        text += "| --- | --- | --- |\n" + "\n".join(_rows(tp, getattr(cfg, f.name), f.name + ".")) + "\n"
    return text


def render_yaml() -> str:
    head = "# klppo's defaults (verl's ppo_trainer.yaml key set). Generated by `python -m klppo.config.docgen`.\n"
    return head + OmegaConf.to_yaml(OmegaConf.structured(KLPPOConfig))


def main() -> None:
    (ROOT / "docs" / "configuration.md").write_text(render_docs())
    (ROOT / "klppo" / "config" / "ppo_trainer.yaml").write_text(render_yaml())


if __name__ == "__main__":
    main()
