"""Assembles one rank's run from the resolved config: tokenizer, data, roles (FSDP2-sharded), rollout,
reward, KL controller, trackers and the run directory, as one typed :class:`Run`. Nothing here runs a
training step."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig

from klppo.agent.multi_turn import MultiTurnRollout
from klppo.algorithms.advantages import get_advantage_estimator
from klppo.algorithms.kl_control import KLController, make_kl_controller
from klppo.assembly.data_check import build_loaders, tokenizer_trusts_code
from klppo.assembly.memory_check import critic_model_config
from klppo.assembly.roles_build import HFAssets, RoleInputs, Roles, SequenceGroups, build_roles, role_fsdp
from klppo.assembly.run_start import begin_run
from klppo.assembly.settings import (
    engine_settings,
    multi_turn_settings,
    reads_law_log_probs,
    sampling_params,
    to_dtype,
    tune_workload,
)
from klppo.config import KLPPOConfig, config_to_yaml, derive_sizes, total_training_steps
from klppo.config.checks import (
    background_scoring_advice,
    compiled_layers_advice,
    critic_budget_advice,
    tp_rollout_unbuilt,
)
from klppo.config.schema import KLControlConfig
from klppo.config.schema_arr import KLLossControlConfig
from klppo.config.sizes import Sizes, uses_critic
from klppo.data.dataset import PromptLoader
from klppo.data.logged import LoggedLoader
from klppo.data.mixed import MixedLoader
from klppo.models.compile_cache import use_persistent_cache
from klppo.models.llama_weights import SUPPORTED_MODEL_TYPES
from klppo.models.loading import eos_token_ids, load_tokenizer, model_dir
from klppo.models.lora import is_lora, merged_for_rollout
from klppo.ops.checkpoint import checkpoint_step
from klppo.parallel.collectives import rank, world_size
from klppo.parallel.fsdp import FSDPSettings, gathered_params
from klppo.parallel.mesh import (
    ParallelMesh,
    SequenceParallel,
    TensorParallel,
    build_parallel_mesh,
    build_rollout_mesh,
)
from klppo.parallel.offload import OffloadSchedule
from klppo.rollout.base import RolloutEngine, SamplingParams
from klppo.rollout.compiled import CompiledFunctions
from klppo.rollout.factory import make_rollout
from klppo.tools.config import load_interactions, load_tools
from klppo.tracking import GenerationLog, Tracker
from klppo.tracking.run_dir import claim_run_files, write_run_metadata
from klppo.tune.host import host_ram_bytes
from klppo.tune.preflight import check_memory

log = logging.getLogger("klppo")


@dataclass(frozen=True)
class Sampling:
    """How the rollout samples: for training, for validation (``val_kwargs``), and greedily for the reward
    baseline of estimators that need one (``None`` otherwise)."""

    train: SamplingParams
    val: SamplingParams
    greedy: SamplingParams | None


@dataclass(frozen=True)
class Loaders:
    train: PromptLoader | LoggedLoader | MixedLoader
    """Prompts to generate for, logged samples (``data.logged_files``), or both (``data.logged_share``)."""
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
    identity: dict[str, Any] | None
    """What the run trains, saved with each checkpoint (``klppo.ops.resume_check``; rank 0 only)."""

    @property
    def frozen_bases(self) -> dict[str, dict[str, Any] | None]:
        """The trained roles whose checkpoint leaves their frozen base weights out — a LoRA actor — each
        with the record of its base (the identity's model: path, architecture, weights digest; rank 0's,
        None on the other ranks). A resume loads that base from the model path (``klppo.ops.checkpoint``)."""
        if not is_lora(self.roles.actor.model):
            return {}
        return {"actor": None if self.identity is None else self.identity["model"]}

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


def _start_precompile(
    cfg: KLPPOConfig, hf_config: Any, device: torch.device, compiled: CompiledFunctions
) -> None:
    """Start compiling the klppo engine's decode functions in the background (see rollout.compiled)."""
    rollout = cfg.actor_rollout_ref.rollout
    dtype = to_dtype(cfg.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype)
    # as built (rollout_tensor_parallel): LoRA runs a configured TP size data-parallel, on the split layers
    tensor_parallel = rollout.tensor_model_parallel_size > 1 and tp_rollout_unbuilt(cfg) is None
    if tensor_parallel:
        # the TP engine's layer front runs on this rank's slices (other shapes than a whole layer's) and its
        # back and sampler eagerly: graphs of a whole layer would go unused, and their failed shape guards
        # make dynamo recompile the front with symbolic weight sizes at the first step
        log.info(
            "rollout pre-compile skipped: a tensor-parallel rollout compiles its layer front on its slices"
        )
        return
    sampling = _sampling(cfg)  # what training and validation sample with
    settings = engine_settings(rollout, tensor_parallel=False)
    compiled.start_precompile(
        hf_config, settings, dtype=dtype, device=device, sampling=(sampling.train, sampling.val)
    )


def _before_weights(
    cfg: KLPPOConfig,
    actor_fsdp: FSDPSettings,
    model_path: str,
    device: torch.device,
    compiled: CompiledFunctions | None,
    sizes: Sizes,
) -> None:
    """On a GPU, before any weights load: the memory pre-flight for the actor's FSDP settings, and the
    klppo engine's decode functions (``compiled``, None for another engine) compiling in the background
    while the weights load."""
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    hf_config = AutoConfig.from_pretrained(model_path)
    critic_config = critic_model_config(cfg, model_path)
    workload = tune_workload(
        cfg, actor_fsdp, world_size=world_size(), device_gib=total_gib, critic_config=critic_config
    )
    # per rank, an upper bound (responses may end early), split over a Ulysses group as the tokens of a
    # micro-batch
    per_rank = sizes.actor_mini_batch_samples_per_rank * workload.seq_len
    mini_tokens = -(-per_rank // workload.workload.sequence_parallel)
    rollout = cfg.actor_rollout_ref.rollout
    advise = cfg.trainer.advise
    check_memory(
        workload,
        hf_config,
        mini_batch_tokens=mini_tokens if advise else None,
        host_bytes=host_ram_bytes(),
        rollout_seqs=sizes.samples_per_rank if advise and could_keep_workspace(cfg, hf_config) else None,
    )
    critic_tokens = (sizes.critic_mini_batch_samples_per_rank or 0) * workload.seq_len
    critic_advice = critic_budget_advice(cfg, critic_mini_batch_tokens=critic_tokens)
    advice = [*compiled_layers_advice(cfg), *filter(None, [critic_advice, background_scoring_advice(cfg)])]
    for line in advice if advise else []:
        log.info("advice: %s", line)
    if compiled is not None and not rollout.enforce_eager:
        _start_precompile(cfg, hf_config, device, compiled)


def could_keep_workspace(cfg: KLPPOConfig, hf_config) -> bool:
    """Whether the rollout frees a workspace that it could keep between steps (the pre-flight then weighs
    ``free_cache_engine=False``): the klppo engine on CUDA graphs for this architecture, freeing after each
    step, no tensor parallelism, and one call shape per step — not with an estimator that adds a greedy
    call per step (ReMax), whose two shapes would replace a kept workspace twice a step."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "klppo" or not rollout.free_cache_engine or rollout.enforce_eager:
        return False
    if rollout.tensor_model_parallel_size != 1 or hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        return False
    return not get_advantage_estimator(cfg.algorithm.adv_estimator).needs_reward_baselines


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
        target_kl_start=group.target_kl_start,
        anneal_begin=group.anneal_begin,
        anneal_steps=group.anneal_steps,
    )


def _sampling(cfg: KLPPOConfig) -> Sampling:
    rollout, response_length = cfg.actor_rollout_ref.rollout, cfg.data.max_response_length
    needs_baseline = get_advantage_estimator(cfg.algorithm.adv_estimator).needs_reward_baselines
    return Sampling(
        train=sampling_params(
            rollout,
            response_length=response_length,
            validation=False,
            law_log_probs=reads_law_log_probs(cfg),
        ),
        val=sampling_params(rollout, response_length=response_length, validation=True, law_log_probs=False),
        greedy=SamplingParams(n=1, do_sample=False, max_new_tokens=response_length)
        if needs_baseline
        else None,
    )


def _trackers(cfg: KLPPOConfig, run_dir: Path, resume_path: Path | None, argv: list[str]) -> Trackers:
    tcfg = cfg.trainer
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
    return Trackers(metrics=tracker, generations=GenerationLog(run_dir))


def build_meshes(cfg: KLPPOConfig, device_type: str) -> tuple[dict[int, ParallelMesh], SequenceGroups]:
    """The ranks as ``("dp", "sp")`` meshes, one per Ulysses size the roles use (1 always), and each role's
    sequence-parallel group. Every rank builds the same meshes in the same order (a collective each)."""
    meshes: dict[int, ParallelMesh] = {}

    def group(size: int) -> SequenceParallel | None:
        if size not in meshes:
            meshes[size] = build_parallel_mesh(size, device_type)
        return meshes[size].sequence_parallel

    arr = cfg.actor_rollout_ref
    group(1)
    groups = SequenceGroups(
        actor=group(arr.actor.ulysses_sequence_parallel_size),
        reference=group(arr.ref.ulysses_sequence_parallel_size),
        critic=group(cfg.critic.ulysses_sequence_parallel_size),
    )
    return meshes, groups


def rollout_tensor_parallel(cfg: KLPPOConfig, device_type: str) -> TensorParallel | None:
    """This rank's rollout tensor-parallel group (``rollout.tensor_model_parallel_size``; the mesh is a
    collective), None for 1. LoRA (the adapters would have to be merged into the slices) and the ``hf``
    backend run data-parallel on gathered weights instead (noted when the configuration loads)."""
    group = build_rollout_mesh(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, device_type)
    if group is not None and tp_rollout_unbuilt(cfg):
        return None  # data-parallel on gathered weights: noted when the config loaded (config/checks.py)
    return group


def _rollout_engine(
    cfg: KLPPOConfig,
    tokenizer: Any,
    actor_model: torch.nn.Module,
    tensor_parallel: TensorParallel | None,
    compiled: CompiledFunctions | None,
) -> RolloutEngine:
    """The rollout engine of ``actor_rollout_ref.rollout``, handed the compiled functions that ``build_run``
    started pre-compiling (klppo only)."""
    rollout = cfg.actor_rollout_ref.rollout
    eos = eos_token_ids(tokenizer, actor_model.config, getattr(actor_model, "generation_config", None))
    settings = engine_settings(
        rollout,
        tensor_parallel=tensor_parallel is not None,
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    engine = make_rollout(rollout.name, settings, tensor_parallel=tensor_parallel, compiled=compiled)
    mt = rollout.multi_turn
    if not mt.enable:
        return engine
    return MultiTurnRollout(
        engine,
        tokenizer=tokenizer,
        settings=multi_turn_settings(mt),
        eos_token_ids=tuple(eos),
        tools=load_tools(mt.tool_config_path) if mt.tool_config_path else {},
        interactions=load_interactions(mt.interaction_config_path) if mt.interaction_config_path else {},
        chat_template_kwargs=dict(cfg.data.apply_chat_template_kwargs),
    )


def build_run(cfg: KLPPOConfig, *, device: torch.device, argv: list[str]) -> Run:
    """Everything one rank trains with, in the order that lets slow work overlap (pre-compile, weights)."""
    arr, tcfg = cfg.actor_rollout_ref, cfg.trainer
    sizes = derive_sizes(cfg, world_size())
    use_persistent_cache()  # before anything compiles: every compiled part of the run, whatever the engine
    torch.manual_seed(tcfg.seed)
    # a .gguf file → its cached Hugging Face directory
    model_path = model_dir(arr.model.path, key="actor_rollout_ref.model.path")
    tokenizer_path = (
        model_dir(arr.model.tokenizer_path, key="actor_rollout_ref.model.tokenizer_path")
        if arr.model.tokenizer_path
        else model_path
    )
    trained = ["actor"] + (["critic"] if uses_critic(cfg) else [])
    # the start recorded; a fresh start over an earlier run, or a resume that changes the run, refused
    start = begin_run(cfg, argv, model_path=model_path, tokenizer_path=tokenizer_path, trained=trained)
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=tokenizer_trusts_code(cfg))
    if arr.model.custom_chat_template:
        tokenizer.chat_template = arr.model.custom_chat_template
    actor_fsdp = role_fsdp("actor", arr.actor.fsdp_config, device)  # shards and is predicted
    # the klppo engine's compiled decode functions: made here, pre-compiling while the weights load
    compiled = CompiledFunctions() if arr.rollout.name == "klppo" else None
    if device.type == "cuda":
        _before_weights(cfg, actor_fsdp, model_path, device, compiled, sizes)
    train_loader, val_loader = build_loaders(cfg, tokenizer)
    total_steps = total_training_steps(tcfg, len(train_loader))
    if len(train_loader) == 0:
        raise ValueError("the training set gives no full batch of data.train_batch_size prompts")
    run_dir = Path(tcfg.default_local_dir).expanduser()
    offload, hf_assets = OffloadSchedule(device), {}
    meshes, sp = build_meshes(cfg, device.type)
    rollout_tp = rollout_tensor_parallel(cfg, device.type)
    inputs = RoleInputs(cfg, sizes, model_path, tokenizer, device, total_steps, offload, hf_assets, sp)
    roles = build_roles(inputs, actor_fsdp)
    rollout = _rollout_engine(cfg, tokenizer, roles.actor.model, rollout_tp, compiled)
    resume_path = start.resume_path
    if rank() == 0:
        claim_run_files(run_dir)  # before the trackers open metrics.jsonl
    return Run(
        cfg=cfg,
        device=device,
        tokenizer=tokenizer,
        loaders=Loaders(train=train_loader, val=val_loader),
        roles=roles,
        rollout=rollout,
        sampling=_sampling(cfg),
        kl_ctrl=kl_controller(cfg.algorithm.kl_ctrl, cfg.algorithm.kl_ctrl.kl_coef),
        kl_loss_ctrl=kl_controller(arr.actor.kl_loss_ctrl, arr.actor.kl_loss_coef),
        trackers=_trackers(cfg, run_dir, resume_path, argv),
        offload=offload,
        meshes=meshes,
        run_dir=run_dir,
        total_training_steps=total_steps,
        hf_assets=hf_assets,
        free_cache_engine=arr.rollout.free_cache_engine,
        resume_path=resume_path,
        identity=start.identity,
    )
