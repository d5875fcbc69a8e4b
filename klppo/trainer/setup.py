"""Assembles one rank's run from the resolved config: tokenizer, data, roles (FSDP2-sharded), rollout,
reward, KL controller, trackers and the run directory, as one typed :class:`Run`. Nothing here runs a
training step."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from klppo.algorithms.kl_control import KLController, make_kl_controller
from klppo.config import KLPPOConfig
from klppo.config.schema import KLControlConfig
from klppo.config.schema_arr import KLLossControlConfig, RolloutConfig
from klppo.data.dataset import PromptLoader
from klppo.models.lora import is_lora, merged_for_rollout
from klppo.parallel.fsdp import gathered_params
from klppo.parallel.mesh import ParallelMesh, SequenceParallel, build_parallel_mesh, build_rollout_mesh
from klppo.parallel.offload import OffloadSchedule
from klppo.roles.actor import Actor
from klppo.roles.critic import Critic
from klppo.roles.reference import Reference
from klppo.roles.reward import Reward
from klppo.roles.trained import TrainedRole
from klppo.rollout.base import RolloutEngine, SamplingParams
from klppo.tracking import GenerationLog, Tracker
from klppo.trainer.roles_build import HFAssets, build_actor, build_critic, build_reference, build_reward

log = logging.getLogger("klppo")


@dataclass(frozen=True)
class Roles:
    """The run's models: the actor always; the reference when a KL term needs it; the critic for GAE."""

    actor: Actor
    reference: Reference | None
    critic: Critic | None
    reward: Reward

    def trained(self) -> dict[str, TrainedRole]:
        """The roles with weights and an optimizer to checkpoint, by name."""
        roles: dict[str, TrainedRole] = {"actor": self.actor}
        if self.critic is not None:
            roles["critic"] = self.critic
        return roles


@dataclass(frozen=True)
class Sampling:
    """How the rollout samples: for training, for validation (``val_kwargs``), and greedily for the reward
    baseline of estimators that need one (``None`` otherwise)."""

    train: SamplingParams
    val: SamplingParams
    greedy: SamplingParams | None


@dataclass(frozen=True)
class Loaders:
    train: PromptLoader
    val: PromptLoader | None


@dataclass(frozen=True)
class Trackers:
    metrics: Tracker
    generations: GenerationLog


@dataclass(frozen=True)
class Run:
    """One rank's run, built once by :func:`build_run`; the trainer reads it and never adds to it."""

    cfg: KLPPOConfig
    device: torch.device
    tokenizer: Any  # a transformers tokenizer
    loaders: Loaders
    roles: Roles
    rollout: RolloutEngine
    sampling: Sampling
    kl_ctrl: KLController
    """β of the KL penalty in the reward (``algorithm.kl_ctrl``)."""
    kl_loss_ctrl: KLController
    """β of the actor's KL loss (``actor.kl_loss_ctrl``)."""
    trackers: Trackers
    offload: OffloadSchedule
    meshes: dict[int, ParallelMesh]
    """The ranks as ``("dp", "sp")`` meshes, by Ulysses size (one per size the roles use, 1 always)."""
    run_dir: Path
    total_training_steps: int
    hf_assets: HFAssets
    free_cache_engine: bool
    resume_path: Path | None

    @contextlib.contextmanager
    def gather_weights(self) -> Iterator[torch.nn.Module]:
        """The model the rollout engine runs on: the actor with its full weights gathered (FSDP2 unshard in
        place), and with LoRA the base model with the adapters merged (restored afterwards); a
        tensor-parallel engine (``reads_shards``) takes the sharded actor as it is and reshards it."""
        model = self.roles.actor.model
        if getattr(self.rollout, "reads_shards", False):
            yield model
            return
        with gathered_params(model):
            if is_lora(model):
                with merged_for_rollout(model) as merged:
                    yield merged
            else:
                yield model


def data_paths(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def build_loaders(cfg: Any, tokenizer: Any):
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
        data_paths(d.train_files),
        tokenizer,
        batch_size=int(d.train_batch_size),
        shuffle=bool(d.shuffle),
        seed=int(d.seed if d.seed is not None else cfg.trainer.seed),
        drop_last=True,
        shuffle_buffer_rows=d.shuffle_buffer_rows,
        max_samples=d.train_max_samples,
        **common,
    )
    val = None
    val_files = data_paths(d.val_files)
    if val_files:
        val_bs = d.val_batch_size or 10**9
        val = PromptLoader(
            val_files,
            tokenizer,
            batch_size=int(val_bs),
            shuffle=bool(d.validation_shuffle),
            seed=0,
            drop_last=False,
            max_samples=d.val_max_samples,
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


def engine_options(rollout_cfg: RolloutConfig) -> dict[str, bool]:
    """Options of the klppo engine read from the rollout config: `enforce_eager` runs the decode step
    eagerly (no torch.compile, no CUDA graph capture), as vLLM's flag does."""
    if rollout_cfg.name != "klppo" or not rollout_cfg.enforce_eager:
        return {}
    return {"use_cuda_graph": False, "compile_decode": False}


def _start_precompile(cfg: Any, hf_config: Any, device: torch.device) -> None:
    """Start compiling the klppo engine's decode functions in the background (see rollout.compiled)."""
    from klppo.rollout.compiled import start_precompile
    from klppo.trainer.builder import to_dtype

    rcfg = cfg.actor_rollout_ref.rollout
    mp = getattr(cfg.actor_rollout_ref.actor.fsdp_config, "mixed_precision", None)
    temperatures = [
        s.temperature
        for s in (_sampling(rcfg, response_length=1, validation=v) for v in (False, True))
        if s.do_sample
    ]
    start_precompile(
        hf_config,
        dtype=to_dtype(getattr(mp, "param_dtype", None) if mp is not None else None, torch.bfloat16),
        device=device,
        temperatures=temperatures,
    )


def kl_controller(group: KLControlConfig | KLLossControlConfig, init_coef: float) -> KLController:
    """A β controller from an ``algorithm.kl_ctrl`` or ``actor.kl_loss_ctrl`` group and its initial β."""
    return make_kl_controller(
        group.type,
        kl_coef=init_coef,
        target_kl=group.target_kl,
        horizon=group.horizon,
        kp=group.kp,
        ki=group.ki,
        min_coef=group.min_coef,
        max_coef=group.max_coef,
    )


def build_run(cfg: KLPPOConfig, *, device: torch.device, argv: list[str]) -> Run:
    from klppo.algorithms.advantages import get_advantage_estimator
    from klppo.config import config_to_yaml, derive_sizes
    from klppo.models.loading import eos_token_ids, load_tokenizer, model_dir
    from klppo.parallel.collectives import rank, world_size
    from klppo.rollout.base import make_rollout
    from klppo.tracking.run_dir import claim_run_files, write_run_metadata
    from klppo.trainer.checkpoint import checkpoint_step, resolve_resume

    arr, algo, tcfg = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    rcfg = arr.rollout
    sizes = derive_sizes(cfg, world_size())
    torch.manual_seed(int(tcfg.seed))

    model_path = model_dir(arr.model.path)  # a .gguf file → its cached Hugging Face directory
    tokenizer = load_tokenizer(
        model_dir(arr.model.tokenizer_path) if arr.model.tokenizer_path else model_path
    )
    if arr.model.custom_chat_template:
        tokenizer.chat_template = arr.model.custom_chat_template
    if device.type == "cuda":
        from transformers import AutoConfig

        from klppo.tune.preflight import check_memory

        total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
        hf_config = AutoConfig.from_pretrained(model_path)
        check_memory(cfg, hf_config, world_size=world_size(), device_gib=total_gib)
        if rcfg.name == "klppo" and not rcfg.enforce_eager:  # compile the decode functions while weights load
            _start_precompile(cfg, hf_config, device)
    train_loader, val_loader = build_loaders(cfg, tokenizer)
    total_steps = tcfg.total_training_steps or len(train_loader) * int(tcfg.total_epochs)
    if len(train_loader) == 0:
        raise ValueError("the training set gives no full batch of data.train_batch_size prompts")

    run_dir = Path(tcfg.default_local_dir).expanduser()
    offload = OffloadSchedule(device)
    hf_assets: dict[str, Callable[[Path], None]] = {}

    meshes: dict[int, ParallelMesh] = {}

    def sp_group(size: int) -> SequenceParallel | None:
        if size not in meshes:  # every rank builds the same meshes in the same order
            meshes[size] = build_parallel_mesh(int(size), device.type)
        return meshes[size].sequence_parallel

    sp_group(1)
    rollout_tp = build_rollout_mesh(int(rcfg.tensor_model_parallel_size), device.type)
    if rollout_tp is not None and (int(arr.model.lora_rank or 0) > 0 or rcfg.name != "klppo"):
        why = "LoRA (lora_rank > 0)" if int(arr.model.lora_rank or 0) > 0 else f"rollout.name={rcfg.name}"
        log.warning(
            "actor_rollout_ref.rollout.tensor_model_parallel_size=%d is not built with %s: the rollout runs "
            "data-parallel on gathered weights (same results, the whole model on every GPU)",
            rollout_tp.size,
            why,
        )
        rollout_tp = None
    role_args = dict(device=device, total_steps=total_steps, offload=offload, hf_assets=hf_assets)
    actor = build_actor(cfg, sizes, model_path, tokenizer, **role_args,
                        sp=sp_group(arr.actor.ulysses_sequence_parallel_size))  # fmt: skip
    reference = build_reference(cfg, sizes, model_path, device=device, offload=offload, actor=actor,
                                sp=sp_group(arr.ref.ulysses_sequence_parallel_size))  # fmt: skip
    critic = build_critic(cfg, sizes, model_path, tokenizer, **role_args,
                          sp=sp_group(cfg.critic.ulysses_sequence_parallel_size))  # fmt: skip
    reward = build_reward(cfg, tokenizer, device)
    rollout = make_rollout(
        rcfg.name,
        eos_token_ids=eos_token_ids(
            tokenizer, actor.model.config, getattr(actor.model, "generation_config", None)
        ),
        pad_token_id=tokenizer.pad_token_id,
        gpu_memory_utilization=float(rcfg.gpu_memory_utilization),
        free_cache_engine=bool(rcfg.free_cache_engine),
        tensor_parallel=rollout_tp,
        **engine_options(rcfg),
    )
    response_length = int(cfg.data.max_response_length)
    sampling = _sampling(rcfg, response_length=response_length, validation=False)
    roles = ["actor"] + (["critic"] if critic is not None else [])
    resume_path = resolve_resume(tcfg.resume_mode, run_dir, tcfg.resume_from_path, roles=roles)
    if rank() == 0:
        claim_run_files(run_dir)  # before the trackers open metrics.jsonl
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
    needs_baseline = get_advantage_estimator(algo.adv_estimator).needs_reward_baselines
    return Run(
        cfg=cfg,
        device=device,
        tokenizer=tokenizer,
        loaders=Loaders(train=train_loader, val=val_loader),
        roles=Roles(actor=actor, reference=reference, critic=critic, reward=reward),
        rollout=rollout,
        sampling=Sampling(
            train=sampling,
            val=_sampling(rcfg, response_length=response_length, validation=True),
            greedy=SamplingParams(n=1, do_sample=False, max_new_tokens=response_length)
            if needs_baseline
            else None,
        ),
        kl_ctrl=kl_controller(algo.kl_ctrl, algo.kl_ctrl.kl_coef),
        kl_loss_ctrl=kl_controller(arr.actor.kl_loss_ctrl, arr.actor.kl_loss_coef),
        trackers=Trackers(metrics=tracker, generations=GenerationLog(run_dir)),
        offload=offload,
        meshes=meshes,
        run_dir=run_dir,
        total_training_steps=int(total_steps),
        hf_assets=hf_assets,
        free_cache_engine=bool(rcfg.free_cache_engine),
        resume_path=resume_path,
    )
