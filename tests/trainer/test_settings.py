"""verl keys → settings objects (klppo/assembly/settings.py): each translation against the config it reads."""

from __future__ import annotations

import pytest
import torch

from klppo.algorithms.policy_losses import ClipCovOptions
from klppo.assembly.settings import (
    actor_settings,
    critic_settings,
    fsdp_settings,
    loader_settings,
    optim_settings,
    reference_settings,
    sampling_params,
    tune_workload,
)
from klppo.config import derive_sizes, load_config
from klppo.config.errors import ConfigError
from klppo.data import LoaderSettings
from klppo.parallel.mesh import SequenceParallel


def test_fsdp_settings_mixed_precision_only_on_gpu() -> None:
    cfg = load_config(
        [
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=1000",
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[Block]",
            "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16",
        ]
    )
    fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    cpu, gpu = (
        fsdp_settings(fsdp, device_type="cpu", world_size=2),
        fsdp_settings(fsdp, device_type="cuda", world_size=2),
    )
    assert cpu.param_dtype is None and gpu.param_dtype == torch.bfloat16
    assert cpu.reduce_dtype == gpu.reduce_dtype == torch.bfloat16
    assert (gpu.min_num_params, gpu.transformer_layer_cls_to_wrap, gpu.fsdp_size) == (1000, ["Block"], 2)
    assert (
        fsdp_settings(
            load_config([]).critic.model.fsdp_config, device_type="cpu", world_size=1
        ).transformer_layer_cls_to_wrap
        is None
    )


def test_optim_settings_schedule_warmup_and_extra_arguments() -> None:
    cfg = load_config(
        [
            "actor_rollout_ref.actor.optim.warmup_style=cosine",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=0",
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
            "actor_rollout_ref.actor.optim.betas=[0.8,0.9]",
            "actor_rollout_ref.actor.optim.override_optimizer_config={eps: 1e-5}",
        ]
    )
    s = optim_settings(cfg.actor_rollout_ref.actor.optim, total_steps=0)
    assert (
        s.schedule == "cosine" and s.warmup_steps == -1 and s.warmup_steps_ratio == 0.1
    )  # 0: from the ratio
    assert s.betas == (0.8, 0.9) and s.extra == (("eps", 1e-5),) and s.total_steps == 1
    plain = optim_settings(load_config(["critic.optim.lr_warmup_steps=3"]).critic.optim, total_steps=10)
    assert (plain.warmup_steps, plain.schedule, plain.extra) == (3, "constant", ())


def test_role_settings_carry_the_per_rank_sizes_and_the_rollout_temperature() -> None:
    cfg = load_config(
        [
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.ppo_epochs=3",
            "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
            "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
            "critic.ppo_micro_batch_size_per_gpu=2",
            "trainer.seed=5",
        ]
    )
    sizes = derive_sizes(cfg, 2)
    actor = actor_settings(cfg, sizes)
    assert (actor.ppo_epochs, actor.mini_batch_size, actor.temperature, actor.seed) == (3, 4, 0.7, 5)
    assert actor.update_micro.micro_batch_size == 2 and not actor.update_micro.use_dynamic_bsz
    assert actor.policy_loss_options == ClipCovOptions()  # the schema's defaults
    ref = reference_settings(cfg, sizes)
    assert ref.micro.use_dynamic_bsz and ref.temperature == 0.7
    critic = critic_settings(cfg, sizes)
    assert critic.mini_batch_size == sizes.critic_mini_batch_samples_per_rank and critic.seed == 5
    greedy = load_config(["actor_rollout_ref.rollout.temperature=0"])
    assert actor_settings(greedy, derive_sizes(greedy, 1)).temperature == 1.0
    load_config(
        [f"{r}.fsdp_config.local_shard_optim=true" for r in ("actor_rollout_ref.actor", "critic.model")]
    )
    for role in (
        "actor_rollout_ref.actor",
        "actor_rollout_ref.ref",
        "critic.model",
    ):  # no DTensor-dispatch path
        with pytest.raises(
            ConfigError, match=rf"{role}\.fsdp_config\.local_shard_optim=False: .*remove the key"
        ):
            load_config([f"{role}.fsdp_config.local_shard_optim=false"])


def test_sampling_and_loaders() -> None:
    cfg = load_config(
        [
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
            "data.val_files=null",
            "data.train_files=[a.parquet, b.parquet]",
            "trainer.seed=9",
        ]
    )
    rollout = cfg.actor_rollout_ref.rollout
    train = sampling_params(rollout, response_length=7, validation=False)
    val = sampling_params(rollout, response_length=7, validation=True)
    assert (train.n, train.do_sample, train.max_new_tokens) == (4, True, 7)
    assert (val.n, val.do_sample, val.temperature) == (1, False, 1.0)
    loader = loader_settings(cfg.data, seed=cfg.trainer.seed, validation=False)
    assert loader.files == ["a.parquet", "b.parquet"] and loader.seed == 9 and loader.drop_last
    assert loader_settings(cfg.data, seed=9, validation=True) is None
    val_loader = loader_settings(load_config(["data.val_batch_size=3"]).data, seed=1, validation=True)
    assert (val_loader.batch_size, val_loader.seed, val_loader.drop_last, val_loader.shuffle) == (
        3,
        0,
        False,
        False,
    )
    assert isinstance(val_loader, LoaderSettings)  # the loader's own settings object, built once


def test_a_ulysses_group_gets_its_token_budgets_and_the_tune_workload_its_sizes() -> None:
    """With a Ulysses group of S ranks every token budget of the role is the group's (× S), the group rides
    along in the settings, and the memory model sees S, the rollout's TP and a fixed micro-batch's tokens
    split over the group (ceil)."""
    cfg = load_config(
        [
            "data.max_prompt_length=100",
            "data.max_response_length=100",
            "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1000",
            "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
            "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=700",
            "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=300",
            "critic.ppo_max_token_len_per_gpu=500",
            "critic.forward_max_token_len_per_gpu=600",
        ]
    )
    sizes = derive_sizes(cfg, 1)
    sp = SequenceParallel(group=None, size=2, rank=1)
    plain, split = actor_settings(cfg, sizes), actor_settings(cfg, sizes, sp=sp)
    assert plain.sp is None and split.sp is sp
    assert (plain.update_micro.max_token_len, split.update_micro.max_token_len) == (1000, 2000)
    assert (plain.log_prob_micro.max_token_len, split.log_prob_micro.max_token_len) == (700, 1400)
    assert reference_settings(cfg, sizes, sp=sp).micro.max_token_len == 600
    critic = critic_settings(cfg, sizes, sp=sp)
    assert (critic.update_micro.max_token_len, critic.forward_micro.max_token_len, critic.sp) == (
        1000,
        1200,
        sp,
    )

    fixed = load_config(
        [
            "data.max_prompt_length=7",
            "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        ]
    )
    fsdp = fsdp_settings(fixed.actor_rollout_ref.actor.fsdp_config, device_type="cuda", world_size=2)
    tw = tune_workload(fixed, fsdp, world_size=4, device_gib=80)
    assert (tw.workload.sequence_parallel, tw.workload.rollout_tensor_parallel) == (2, 2)
    assert tw.update_micro_tokens == 23  # ceil(3 rows × 15 tokens / 2 ranks)


class _Recording:
    """A stand-in for ``CompiledFunctions`` that records what the trainer's set-up asks to pre-compile."""

    args = None

    def start_precompile(self, config, settings, **kwargs):
        self.args = (settings, kwargs)


def test_setup_precompile_gets_the_engine_settings_and_every_sampling_setting() -> None:
    """The trainer's pre-compile runs on the object it is given (the one build_run hands to the engine), with
    the engine's settings and the sampling settings of training (0.7) and validation (0.5)."""
    from klppo.assembly.setup import _start_precompile

    cfg = load_config(
        [
            "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.5",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
            "actor_rollout_ref.rollout.sampler=torch",
        ]
    )
    fns = _Recording()
    _start_precompile(cfg, None, torch.device("cpu"), fns)
    settings, kwargs = fns.args
    assert settings.sampler == "torch" and kwargs["device"] == torch.device("cpu")
    assert [p.temperature for p in kwargs["sampling"]] == [0.7, 0.5]
    assert [p.law_log_probs for p in kwargs["sampling"]] == [False, False]  # no rollout correction reads them


@pytest.mark.parametrize(
    ("overrides", "law"),
    [
        ([], False),
        (["algorithm.rollout_correction.rollout_is=token"], True),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2.0",
            ],
            True,
        ),
        (["algorithm.rollout_correction.bypass_mode=True"], True),
    ],
)
def test_truncated_law_log_probs_are_sampled_where_a_correction_reads_them(overrides, law) -> None:
    """Training samples ask for the truncated law's log-probs only where a rollout correction reads them
    (the Triton sampler's kept-mass pass costs more than its kernel); validation never does; the pre-compile
    warms the same settings."""
    from klppo.assembly.setup import _sampling, _start_precompile

    cfg = load_config(["actor_rollout_ref.rollout.top_p=0.9", *overrides])
    sampling = _sampling(cfg)
    assert (sampling.train.law_log_probs, sampling.val.law_log_probs) == (law, False)
    fns = _Recording()
    _start_precompile(cfg, None, torch.device("cpu"), fns)
    assert [p.law_log_probs for p in fns.args[1]["sampling"]] == [law, False]


@pytest.mark.parametrize(
    ("overrides", "split"),
    [
        ([], True),
        (["actor_rollout_ref.rollout.decode_attention=sdpa"], False),
        (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], None),  # TP: no pre-compile (slices)
        # LoRA: the configured TP size runs data-parallel on gathered weights, on the split layers
        (
            ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.model.lora_rank=8"],
            True,
        ),
    ],
)
def test_setup_precompile_prepares_the_backend_the_built_engine_decodes_on(
    monkeypatch, overrides, split
) -> None:
    """On CUDA with triton (faked: only the arguments are recorded) the pre-compile is asked for the split
    backend exactly when the engine the trainer builds decodes on it: not with ``decode_attention=sdpa``,
    but for a LoRA actor whose configured TP size is run data-parallel (``rollout_tensor_parallel``); a
    tensor-parallel rollout gets none (``split`` None: its front runs on slices of other shapes)."""
    from klppo.assembly.setup import _start_precompile
    from klppo.rollout import backends, triton_attention

    monkeypatch.setattr(triton_attention, "available", lambda device: True)
    fns = _Recording()
    device = torch.device("cuda", 0)
    _start_precompile(load_config(overrides), None, device, fns)
    if split is None:
        assert fns.args is None
        return
    settings, kwargs = fns.args
    chosen = backends.backend_class(settings, device, kwargs["dtype"], tensor_parallel=False)
    assert (chosen is backends.SplitBackend) is split


def test_grad_sync_per_mini_batch_key_is_validated_and_resolved() -> None:
    """The klppo key takes auto / true / false (one-line error naming the key otherwise); the trainer's
    resolution is the memory model's rule, with its cost 4 bytes per trainable parameter."""
    from klppo.assembly.settings import grad_sync_per_mini_batch
    from klppo.config.errors import ConfigError

    key = "critic.model.fsdp_config.grad_sync_per_mini_batch"
    default = load_config([])
    assert default.critic.model.fsdp_config.grad_sync_per_mini_batch == "auto"  # docs/performance.md
    assert load_config([f"{key}=true"]).critic.model.fsdp_config.grad_sync_per_mini_batch is True
    with pytest.raises(ConfigError, match=key):
        load_config([f"{key}=sometimes"])
    default_fsdp_cfg = default.actor_rollout_ref.actor.fsdp_config
    default_fsdp = fsdp_settings(default_fsdp_cfg, device_type="cuda", world_size=2)
    assert grad_sync_per_mini_batch(  # the default (auto) defers with 2 ranks
        default_fsdp_cfg, default_fsdp, num_trainable=10**6, ranks=2, device_bytes=141 * 2**30
    )[0]
    cfg = load_config(["actor_rollout_ref.actor.fsdp_config.grad_sync_per_mini_batch=auto"])
    fsdp_cfg = cfg.actor_rollout_ref.actor.fsdp_config
    fsdp = fsdp_settings(fsdp_cfg, device_type="cuda", world_size=2)
    gib = 2**30
    # 0.5B (494M params): 1.84 GiB of fp32 gradients, on with 2 ranks on a 141 GiB device
    assert grad_sync_per_mini_batch(
        fsdp_cfg, fsdp, num_trainable=494_032_768, ranks=2, device_bytes=141 * gib
    )[0]
    # 7.6B: 28 GiB > 10% of the device: off under auto
    on, why = grad_sync_per_mini_batch(
        fsdp_cfg, fsdp, num_trainable=7_615_616_512, ranks=2, device_bytes=141 * gib
    )
    assert not on and "10%" in why
    assert not grad_sync_per_mini_batch(fsdp_cfg, fsdp, num_trainable=10**6, ranks=1, device_bytes=None)[0]
    offloaded = fsdp_settings(
        load_config(
            [
                "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                "actor_rollout_ref.actor.fsdp_config.grad_sync_per_mini_batch=auto",
            ]
        ).actor_rollout_ref.actor.fsdp_config,
        device_type="cuda",
        world_size=2,
    )
    assert not grad_sync_per_mini_batch(fsdp_cfg, offloaded, num_trainable=10**6, ranks=2, device_bytes=None)[
        0
    ]


def test_min_num_params_auto_is_one_unit_on_one_process_without_offload() -> None:
    """``wrap_policy.min_num_params`` auto (the default): the whole model one FSDP unit when one process
    trains and the role offloads nothing; 0 (a unit per decoder layer, verl's default) with more processes
    or any offload; a number as set; anything else refused at load, naming the key."""
    from klppo.assembly.settings import resolve_min_num_params
    from klppo.config.errors import ConfigError
    from klppo.tune.units import WHOLE_MODEL

    key = "actor_rollout_ref.actor.fsdp_config"
    default = load_config([]).actor_rollout_ref.actor.fsdp_config
    assert default.wrap_policy.min_num_params == "auto"
    assert resolve_min_num_params(default, world_size=1) == (
        WHOLE_MODEL,
        "auto: one process, one unit for the whole model",
    )
    assert resolve_min_num_params(default, world_size=2)[0] == 0
    assert fsdp_settings(default, device_type="cuda", world_size=1).min_num_params == WHOLE_MODEL
    assert fsdp_settings(default, device_type="cuda", world_size=8).min_num_params == 0
    for offload in ("param_offload", "optimizer_offload", "offload_policy"):
        cfg = load_config([f"{key}.{offload}=True"]).actor_rollout_ref.actor.fsdp_config
        value, why = resolve_min_num_params(cfg, world_size=1)
        assert value == 0 and offload in why
    for role in ("actor_rollout_ref.ref.fsdp_config", "critic.model.fsdp_config"):
        cfg = load_config([f"{role}.wrap_policy.min_num_params=0"])
        sub = cfg.actor_rollout_ref.ref.fsdp_config if "ref" in role else cfg.critic.model.fsdp_config
        assert resolve_min_num_params(sub, world_size=1) == (0, "set")  # set: kept, also on one process
    for bad in ("whole", "-1"):
        with pytest.raises(ConfigError, match=f"{key}.wrap_policy.min_num_params"):
            load_config([f"{key}.wrap_policy.min_num_params={bad}"])


def test_one_process_shards_each_role_as_one_unit_unless_set(
    tiny_model_dir, arithmetic_data, tmp_path
) -> None:
    """Through the trainer on one process with FSDP2 (plain_single_gpu=false; auto takes the plain path
    there, test_plain.py): the actor and the reference (min_num_params auto) are one FSDP unit each, the
    critic set to 0 gets one unit per decoder layer plus the root."""
    from klppo.parallel.fsdp import fsdp_modules
    from tests.trainer.utils import base_overrides, run_training

    overrides = (
        base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run")
        + [
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "critic.model.fsdp_config.wrap_policy.min_num_params=0",
        ]
        + [
            f"{r}.fsdp_config.plain_single_gpu=false"
            for r in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
        ]
    )
    _, run = run_training(overrides)
    roles = run.roles
    assert roles.actor.masters is None and roles.critic.masters is None
    assert [len(fsdp_modules(r.model)) for r in (roles.actor, roles.reference)] == [1, 1]
    layers = roles.critic.model.config.num_hidden_layers
    assert len(fsdp_modules(roles.critic.model)) == layers + 1


def test_plain_single_gpu_key_is_validated_and_resolved() -> None:
    """auto (the default): the plain path on one process that offloads nothing, FSDP2 otherwise; true
    where it cannot hold: a one-line error naming the key; a value other than auto/true/false refused."""
    key = "critic.model.fsdp_config"
    default = load_config([])
    for fsdp in (default.actor_rollout_ref.actor.fsdp_config, default.critic.model.fsdp_config):
        assert fsdp.plain_single_gpu == "auto"
        assert fsdp_settings(fsdp, device_type="cuda", world_size=1).plain
        assert not fsdp_settings(fsdp, device_type="cuda", world_size=2).plain
    policy = load_config([f"{key}.offload_policy=true"]).critic.model.fsdp_config
    assert not fsdp_settings(policy, device_type="cuda", world_size=1).plain
    for offload in (
        "param_offload",
        "optimizer_offload",
    ):  # auto: offloading stays on FSDP2 (not GPU-run yet)
        idle = load_config([f"{key}.{offload}=true"]).critic.model.fsdp_config
        assert not fsdp_settings(idle, device_type="cuda", world_size=1).plain
        forced = load_config(
            [f"{key}.{offload}=true", f"{key}.plain_single_gpu=true"]
        ).critic.model.fsdp_config
        assert fsdp_settings(forced, device_type="cuda", world_size=1).plain
    off = load_config([f"{key}.plain_single_gpu=false"]).critic.model.fsdp_config
    assert not fsdp_settings(off, device_type="cuda", world_size=1).plain
    on = load_config([f"{key}.plain_single_gpu=true"]).critic.model.fsdp_config
    assert fsdp_settings(on, device_type="cuda", world_size=1, key=key).plain
    with pytest.raises(
        ValueError, match=r"critic\.model\.fsdp_config\.plain_single_gpu=true needs one process"
    ):
        fsdp_settings(on, device_type="cuda", world_size=2, key=key)
    with pytest.raises(ConfigError, match="plain_single_gpu"):
        load_config([f"{key}.plain_single_gpu=sometimes"])


def test_cuda_graph_update_reaches_the_roles_and_is_refused_where_it_cannot_capture() -> None:
    from klppo.assembly.settings import actor_settings, check_cuda_graph_update, critic_settings
    from klppo.config import derive_sizes

    a, c = "actor_rollout_ref.actor.fsdp_config", "critic.model.fsdp_config"
    cfg = load_config([f"{a}.cuda_graph_update=true", f"{c}.cuda_graph_update=true"])
    sizes = derive_sizes(cfg, 1)
    assert actor_settings(cfg, sizes).cuda_graph_update and critic_settings(cfg, sizes).cuda_graph_update
    default = load_config([])
    assert not actor_settings(default, derive_sizes(default, 1)).cuda_graph_update
    fsdp = cfg.critic.model.fsdp_config
    check_cuda_graph_update(
        fsdp, fsdp_settings(fsdp, device_type="cuda", world_size=1), device_type="cuda", key=c
    )
    cases = [
        ([], "cpu", 1, r"needs a GPU \(trainer\.device=cpu\)"),
        ([], "cuda", 2, "needs the plain path"),
        ([f"{c}.param_offload=true"], "cuda", 1, "needs the plain path"),  # auto: offloading roles on FSDP2
        (
            [f"{c}.param_offload=true", f"{c}.plain_single_gpu=true"],
            "cuda",
            1,
            r"needs parameters that stay on the device \(param_offload=false\)",
        ),
    ]
    for extra, device, world, message in cases:
        f = load_config([f"{c}.cuda_graph_update=true", *extra]).critic.model.fsdp_config
        settings = fsdp_settings(f, device_type=device, world_size=world, key=c)
        with pytest.raises(
            ValueError, match=rf"critic\.model\.fsdp_config\.cuda_graph_update=true {message}"
        ):
            check_cuda_graph_update(f, settings, device_type=device, key=c)


def test_grad_sync_per_mini_batch_is_off_and_said_so_on_the_plain_path():
    """grad_sync_per_mini_batch=true on the plain path (one process, no FSDP2) defers nothing: resolved off,
    and the reason logged says why, not 'once per mini-batch'."""
    from klppo.assembly.settings import fsdp_settings, grad_sync_per_mini_batch

    cfg = load_config(["actor_rollout_ref.actor.fsdp_config.grad_sync_per_mini_batch=true"])
    fsdp_cfg = cfg.actor_rollout_ref.actor.fsdp_config
    plain = fsdp_settings(fsdp_cfg, device_type="cpu", world_size=1)
    assert plain.plain
    on, why = grad_sync_per_mini_batch(fsdp_cfg, plain, num_trainable=10, ranks=1, device_bytes=None)
    assert not on and "plain_single_gpu" in why
