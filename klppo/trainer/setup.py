"""Assembles one rank's run from the resolved config: tokenizer, data, roles (FSDP2-sharded), rollout,
reward, KL controller, trackers and the run directory. Nothing here runs a training step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from klppo.rollout.base import SamplingParams
from klppo.trainer.builder import fsdp_settings, micro, optim_settings, to_dtype

log = logging.getLogger("klppo")


class Offload:
    """Moves a role's parameters / optimizer state to CPU while idle and back before use
    (``param_offload`` / ``optimizer_offload``). Names: actor, ref, actor_optim, critic_optim."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._load: dict[str, Callable[[], None]] = {}
        self._release: dict[str, Callable[[], None]] = {}

    def register(self, name: str, load: Callable[[], None], release: Callable[[], None]) -> None:
        self._load[name], self._release[name] = load, release
        release()

    def load(self, name: str) -> None:
        if name in self._load:
            self._load[name]()

    def release(self, name: str) -> None:
        if name in self._release:
            self._release[name]()


@dataclass
class RunParts:
    cfg: Any
    device: torch.device
    tokenizer: Any
    train_loader: Any
    val_loader: Any
    actor: Any
    reference: Any
    critic: Any
    reward: Any
    rollout: Any
    sampling: SamplingParams
    val_sampling: SamplingParams
    greedy_sampling: SamplingParams
    kl_ctrl: Any
    tracker: Any
    generation_log: Any
    run_dir: Path
    total_training_steps: int
    offload: Offload
    hf_assets: dict[str, Callable[[Path], None]] = field(default_factory=dict)
    free_cache_engine: bool = True
    needs_greedy_baseline: bool = False
    resume_path: Path | None = None

    def trained_roles(self) -> dict[str, Any]:
        roles = {"actor": self.actor}
        if self.critic is not None:
            roles["critic"] = self.critic
        return roles

    def gather_weights(self):
        """Context in which the actor's full weights are materialized for the rollout engine."""
        from klppo.parallel.fsdp import gathered_params

        return gathered_params(self.actor.model)

    @property
    def ref_logits_fn(self):
        return self.reference.logits if self.reference is not None else None


def _paths(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def build_loaders(cfg: Any, tokenizer: Any):
    from klppo.data.dataset import PromptLoader

    d = cfg.data
    common = dict(
        max_prompt_length=int(d.max_prompt_length),
        prompt_key=d.prompt_key,
        filter_overlong_prompts=bool(d.filter_overlong_prompts),
        truncation=d.truncation,
        return_raw_chat=bool(d.return_raw_chat),
        use_chat_template=bool(d.use_chat_template),
        bad_row_policy=d.bad_row_policy,
        max_cached_row_groups=int(d.max_cached_row_groups),
        apply_chat_template_kwargs=dict(d.apply_chat_template_kwargs or {}),
        reward_fn_key=d.reward_fn_key,
    )
    train = PromptLoader(
        _paths(d.train_files),
        tokenizer,
        batch_size=int(d.train_batch_size),
        shuffle=bool(d.shuffle),
        seed=int(d.seed if d.seed is not None else cfg.trainer.seed),
        drop_last=True,
        shuffle_buffer_rows=d.shuffle_buffer_rows,
        **common,
    )
    val = None
    val_files = _paths(d.val_files)
    if val_files:
        val_bs = d.val_batch_size or 10**9
        val = PromptLoader(
            val_files,
            tokenizer,
            batch_size=int(val_bs),
            shuffle=bool(d.validation_shuffle),
            seed=0,
            drop_last=False,
            **common,
        )
    return train, val


def _sampling(rollout_cfg: Any, *, response_length: int, validation: bool) -> SamplingParams:
    src = rollout_cfg.val_kwargs if validation else rollout_cfg
    do_sample = bool(src.do_sample) and float(src.temperature) > 0
    return SamplingParams(
        n=int(src.n),
        temperature=float(src.temperature) if do_sample else 1.0,
        top_p=float(src.top_p),
        top_k=int(src.top_k),
        do_sample=do_sample,
        max_new_tokens=response_length,
        ignore_eos=bool(rollout_cfg.ignore_eos),
    )


def _load_policy_model(cfg: Any, path: str, dtype: torch.dtype, device: torch.device, *, train: bool):
    from klppo.models.loading import load_causal_lm

    m = cfg.actor_rollout_ref.model
    model = load_causal_lm(
        path,
        dtype=dtype,
        device="cpu",
        trust_remote_code=bool(m.trust_remote_code),
        gradient_checkpointing=bool(m.enable_gradient_checkpointing) and train,
        override_config=dict(m.override_config or {}),
    )
    # klppo_packed: block-diagonal attention for packed rows, and for padded rows SDPA with rows that see no
    # key (left padding) attending to themselves, which keeps bf16 gradients finite on GPU
    from klppo.batching.attention import enable_packed_attention

    enable_packed_attention(model)
    return model.to(device)


def _shard(model: torch.nn.Module, fsdp_cfg: Any, device: torch.device, role: str) -> None:
    from klppo.parallel.fsdp import build_mesh, shard_model
    from klppo.roles.dp import world_size

    settings = fsdp_settings(fsdp_cfg, device=device)
    mesh = build_mesh(world_size(), settings.fsdp_size, device.type)
    shard_model(model, settings, mesh)  # logs the units it chose


def build_run(cfg: Any, *, device: torch.device, argv: list[str]) -> RunParts:
    from klppo.algorithms.advantages import get_advantage_estimator, needs_critic
    from klppo.algorithms.kl_control import make_kl_controller
    from klppo.config import config_to_yaml, derive_sizes
    from klppo.models.loading import eos_token_ids, load_critic, load_tokenizer, model_dir
    from klppo.parallel.offload import load_optimizer, load_params, offload_optimizer, offload_params
    from klppo.roles.actor import Actor, ActorSettings
    from klppo.roles.critic import Critic, CriticSettings
    from klppo.roles.dp import rank, world_size
    from klppo.roles.reference import Reference
    from klppo.rollout.base import make_rollout
    from klppo.tracking import Tracker
    from klppo.tracking.run_dir import GenerationLog, write_run_metadata
    from klppo.trainer.checkpoint import checkpoint_step, resolve_resume

    arr, algo, tcfg = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    acfg, rcfg = arr.actor, arr.rollout
    sizes = derive_sizes(cfg, world_size())
    torch.manual_seed(int(tcfg.seed))

    model_path = model_dir(arr.model.path)  # a .gguf file → its cached Hugging Face directory
    tokenizer = load_tokenizer(
        model_dir(arr.model.tokenizer_path) if arr.model.tokenizer_path else model_path
    )
    if arr.model.custom_chat_template:
        tokenizer.chat_template = arr.model.custom_chat_template
    train_loader, val_loader = build_loaders(cfg, tokenizer)
    total_steps = tcfg.total_training_steps or len(train_loader) * int(tcfg.total_epochs)
    if len(train_loader) == 0:
        raise ValueError("the training set gives no full batch of data.train_batch_size prompts")

    run_dir = Path(tcfg.default_local_dir).expanduser()
    offload = Offload(device)
    hf_assets: dict[str, Callable[[Path], None]] = {}

    # actor
    actor_dtype = to_dtype(getattr(acfg.fsdp_config, "model_dtype", "fp32"))
    actor_model = _load_policy_model(cfg, model_path, actor_dtype, device, train=True)
    hf_assets["actor"] = _hf_writer(actor_model, tokenizer)
    _shard(actor_model, acfg.fsdp_config, device, "actor")
    use_rmpad = bool(arr.model.use_remove_padding)
    temperature = float(rcfg.temperature) if float(rcfg.temperature) > 0 else 1.0
    actor = Actor(
        actor_model,
        ActorSettings(
            ppo_epochs=int(acfg.ppo_epochs),
            mini_batch_size=sizes.actor_mini_batch_samples_per_rank,
            update_micro=micro(
                sizes.actor_micro_batch_size_per_gpu,
                dynamic=acfg.use_dynamic_bsz,
                max_tokens=acfg.ppo_max_token_len_per_gpu,
            ),
            log_prob_micro=micro(
                sizes.log_prob_micro_batch_size_per_gpu,
                dynamic=rcfg.log_prob_use_dynamic_bsz,
                max_tokens=rcfg.log_prob_max_token_len_per_gpu,
            ),
            grad_clip=float(acfg.grad_clip),
            clip_ratio=float(acfg.clip_ratio),
            clip_ratio_low=acfg.clip_ratio_low,
            clip_ratio_high=acfg.clip_ratio_high,
            clip_ratio_c=float(acfg.clip_ratio_c),
            loss_agg_mode=acfg.loss_agg_mode,
            entropy_coeff=float(acfg.entropy_coeff),
            use_kl_loss=bool(acfg.use_kl_loss),
            kl_loss_coef=float(acfg.kl_loss_coef),
            kl_loss_type=acfg.kl_loss_type,
            temperature=temperature,
            shuffle=bool(acfg.shuffle),
            use_remove_padding=use_rmpad,
            seed=int(tcfg.seed),
        ),
        optim_settings(acfg.optim, total_steps),
    )
    if acfg.fsdp_config.param_offload:
        offload.register(
            "actor", lambda: load_params(actor.model, device), lambda: offload_params(actor.model)
        )
    if acfg.fsdp_config.optimizer_offload:
        offload.register(
            "actor_optim",
            lambda: load_optimizer(actor.optimizer, device),
            lambda: offload_optimizer(actor.optimizer),
        )

    # reference: only when a KL term needs it
    reference = None
    if algo.use_kl_in_reward or acfg.use_kl_loss:
        # on CPU every role keeps fp32 weights: bf16 matmuls there are slow and would put a rounding KL
        # between the actor and its reference from the first step
        ref_dtype = to_dtype(getattr(arr.ref.fsdp_config, "model_dtype", None), torch.bfloat16)
        ref_model = _load_policy_model(
            cfg, model_path, ref_dtype if device.type == "cuda" else torch.float32, device, train=False
        )
        _shard(ref_model, arr.ref.fsdp_config, device, "ref")
        reference = Reference(
            ref_model,
            micro=micro(
                sizes.ref_log_prob_micro_batch_size_per_gpu,
                dynamic=arr.ref.log_prob_use_dynamic_bsz,
                max_tokens=arr.ref.log_prob_max_token_len_per_gpu,
            ),
            temperature=temperature,
            use_remove_padding=use_rmpad,
        )
        if arr.ref.fsdp_config.param_offload:
            offload.register("ref", lambda: load_params(ref_model, device), lambda: offload_params(ref_model))

    # critic: only for estimators that need values
    critic = None
    if needs_critic(algo.adv_estimator):
        ccfg = cfg.critic
        critic_path = model_dir(ccfg.model.path or model_path)
        critic_model = load_critic(
            critic_path,
            dtype=to_dtype(getattr(ccfg.model.fsdp_config, "model_dtype", "fp32")),
            gradient_checkpointing=bool(ccfg.model.enable_gradient_checkpointing),
        )
        from klppo.batching.attention import enable_packed_attention

        enable_packed_attention(critic_model)
        critic_model = critic_model.to(device)
        hf_assets["critic"] = _hf_writer(critic_model, tokenizer)
        _shard(critic_model, ccfg.model.fsdp_config, device, "critic")
        critic = Critic(
            critic_model,
            CriticSettings(
                ppo_epochs=int(ccfg.ppo_epochs),
                mini_batch_size=sizes.critic_mini_batch_samples_per_rank,
                update_micro=micro(
                    sizes.critic_micro_batch_size_per_gpu,
                    dynamic=ccfg.use_dynamic_bsz,
                    max_tokens=ccfg.ppo_max_token_len_per_gpu,
                ),
                forward_micro=micro(
                    sizes.critic_forward_micro_batch_size_per_gpu,
                    dynamic=ccfg.use_dynamic_bsz,
                    max_tokens=ccfg.forward_max_token_len_per_gpu,
                ),
                grad_clip=float(ccfg.grad_clip),
                cliprange_value=float(ccfg.cliprange_value),
                loss_agg_mode=ccfg.loss_agg_mode,
                shuffle=bool(ccfg.shuffle),
                use_remove_padding=bool(ccfg.model.use_remove_padding),
                seed=int(tcfg.seed),
            ),
            optim_settings(ccfg.optim, total_steps),
        )
        if ccfg.model.fsdp_config.optimizer_offload:
            offload.register(
                "critic_optim",
                lambda: load_optimizer(critic.optimizer, device),
                lambda: offload_optimizer(critic.optimizer),
            )

    reward = _build_reward(cfg, tokenizer, device)
    rollout = make_rollout(
        rcfg.name,
        eos_token_ids=eos_token_ids(
            tokenizer, actor_model.config, getattr(actor_model, "generation_config", None)
        ),
        pad_token_id=tokenizer.pad_token_id,
        gpu_memory_utilization=float(rcfg.gpu_memory_utilization),
        free_cache_engine=bool(rcfg.free_cache_engine),
    )
    response_length = int(cfg.data.max_response_length)
    sampling = _sampling(rcfg, response_length=response_length, validation=False)
    resume_path = resolve_resume(tcfg.resume_mode, run_dir, tcfg.resume_from_path)
    tracker = Tracker(
        list(tcfg.logger),
        run_dir=str(run_dir),
        project_name=tcfg.project_name,
        experiment_name=tcfg.experiment_name,
        config_dict=None,
        rank=rank(),
        resume_step=checkpoint_step(resume_path) if resume_path else None,
    )
    if rank() == 0:
        write_run_metadata(run_dir, config_yaml=config_to_yaml(cfg), argv=argv)
    return RunParts(
        cfg=cfg,
        device=device,
        tokenizer=tokenizer,
        train_loader=train_loader,
        val_loader=val_loader,
        actor=actor,
        reference=reference,
        critic=critic,
        reward=reward,
        rollout=rollout,
        sampling=sampling,
        val_sampling=_sampling(rcfg, response_length=response_length, validation=True),
        greedy_sampling=SamplingParams(n=1, do_sample=False, max_new_tokens=response_length),
        kl_ctrl=make_kl_controller(
            algo.kl_ctrl.type,
            kl_coef=float(algo.kl_ctrl.kl_coef),
            target_kl=algo.kl_ctrl.target_kl,
            horizon=int(algo.kl_ctrl.horizon),
        ),
        tracker=tracker,
        generation_log=GenerationLog(run_dir),
        run_dir=run_dir,
        total_training_steps=int(total_steps),
        offload=offload,
        hf_assets=hf_assets,
        free_cache_engine=bool(rcfg.free_cache_engine),
        needs_greedy_baseline=get_advantage_estimator(algo.adv_estimator).needs_reward_baselines,
        resume_path=resume_path,
    )


def _build_reward(cfg: Any, tokenizer: Any, device: torch.device):
    from klppo.roles.reward import Reward

    rm = cfg.reward_model
    crf = cfg.custom_reward_function
    reward_model = reward_tokenizer = None
    if rm.enable:
        from klppo.models.loading import load_reward_model, load_tokenizer, resolve_model_path

        path = resolve_model_path(rm.model.path)
        reward_model = load_reward_model(
            path, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
        )
        reward_model = reward_model.to(device).eval()
        reward_tokenizer = load_tokenizer(resolve_model_path(rm.model.input_tokenizer or path))
    return Reward(
        tokenizer,
        custom_fn_path=crf.path,
        custom_fn_name=crf.name or "compute_score",
        reward_kwargs=dict(getattr(rm, "reward_kwargs", None) or {}),
        reward_model=reward_model,
        reward_tokenizer=reward_tokenizer,
        max_length=rm.max_length,
    )


def _hf_writer(model: torch.nn.Module, tokenizer: Any) -> Callable[[Path], None]:
    """Writes the model's config, generation config and the tokenizer (taken before sharding)."""
    config = model.config
    generation_config = getattr(model, "generation_config", None)

    def write(path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(path)
        if generation_config is not None:
            generation_config.save_pretrained(path)
        tokenizer.save_pretrained(path)

    return write
