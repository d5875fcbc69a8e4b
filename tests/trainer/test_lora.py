"""LoRA on the actor: only the adapters train, the reference is the actor with adapters off (KL 0 at the
first step, since B starts at 0), rollout runs on merged weights that are restored exactly, a checkpoint
resumes, and `klppo export` folds the adapters into a plain Hugging Face model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.utils import base_overrides, read_metrics, run_training

pytest.importorskip("peft")

LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=all-linear",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.optim.lr=1e-2",
    # a score every group varies in: the tests need a policy gradient, not luck with the arithmetic scorer
    f"custom_reward_function.path={Path(__file__).with_name('length_reward.py')}",
]


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "klppo"])
def test_lora_trains_adapters_only_and_exports_merged(engine, tiny_model_dir, arithmetic_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from klppo.commands.export import main as export_main

    run = tmp_path / "run"
    overrides = (
        base_overrides(tiny_model_dir, arithmetic_data, run)
        + LORA
        + [f"actor_rollout_ref.rollout.name={engine}"]
    )
    state, built = run_training(overrides + ["trainer.total_training_steps=2", "trainer.save_freq=2"])
    rows = read_metrics(run)
    assert rows[0]["actor/ref_kl_k1"] == pytest.approx(0.0, abs=1e-6)  # adapters start at B = 0
    assert all(row["actor/grad_norm"] > 0 for row in rows)

    model = built.roles.actor.model
    assert built.roles.reference.model is model  # no second model in memory
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    optimized = {id(p) for g in built.roles.actor.optimizer.param_groups for p in g["params"]}
    masters = (
        built.roles.actor.state_model
    )  # one process: the plain path's fp32 masters, by the model's names
    assert optimized == {id(p) for p in masters.parameters() if p.requires_grad}
    assert {n for n, p in masters.named_parameters() if p.requires_grad} == trainable

    # base weights are untouched by training and by the merge/restore around each rollout
    from klppo.parallel.fsdp import gathered_params

    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    with gathered_params(model):
        base = model.get_base_model()
        q = base.model.layers[0].self_attn.q_proj
        assert torch.equal(
            q.base_layer.weight.detach().cpu(), original["model.layers.0.self_attn.q_proj.weight"]
        )
        assert q.lora_B["default"].weight.abs().max() > 0  # the adapter learned something

    # export: adapters merged into a plain model that transformers loads, different from the base
    out = tmp_path / "hf"
    assert export_main([str(run / "global_step_2"), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert not any("lora" in k for k in exported)
    diff = (
        exported["model.layers.0.self_attn.q_proj.weight"]
        - original["model.layers.0.self_attn.q_proj.weight"]
    )
    assert diff.abs().max() > 0

    # resume continues from the checkpoint
    state, _ = run_training(overrides + ["trainer.total_training_steps=3"])
    assert state.global_step == 3 and [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_lora_with_full_kl_is_refused(tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.config import ConfigError, check_trainable, load_config

    cfg = load_config(
        base_overrides(tiny_model_dir, arithmetic_data, tmp_path)
        + LORA
        + ["actor_rollout_ref.actor.kl_loss_type=full"]
    )
    with pytest.raises(ConfigError, match="full.*LoRA"):
        check_trainable(cfg)


def test_the_dry_run_lists_no_fsdp_layout_for_the_lora_reference(
    tiny_model_dir, arithmetic_data, tmp_path, capsys
):
    """With LoRA the reference is the actor's own model (adapters off): the plan names it, but shards
    only the actor."""
    from klppo.commands.train import main

    assert main(["--dry-run", *base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run"), *LORA]) == 0
    out = capsys.readouterr().out
    assert "reference (= actor, adapters off)" in out and "actor: no FSDP2, one process" in out
    assert "reference: no FSDP2" not in out and "FSDP2 reference" not in out


def test_rollout_on_merged_lora_equals_the_merged_model():
    """Greedy generation inside merged_for_rollout (our engine and hf) equals hf generate on the
    merge_and_unload()'d model, and the base weights come back bit-identical."""
    from klppo.models.lora import apply_lora, merged_for_rollout
    from klppo.models.tiny import build_tiny_model
    from klppo.rollout import EngineSettings, SamplingParams, make_rollout

    torch.manual_seed(0)
    model = apply_lora(build_tiny_model(), rank=4, alpha=8, target_modules="all-linear")
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)  # non-trivial adapters
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    prompts = torch.randint(3, 300, (3, 7))
    mask = torch.ones_like(prompts)
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    outputs = {}
    for name in ("klppo", "hf"):
        engine = make_rollout(name, EngineSettings(eos_token_ids=[2], pad_token_id=2))
        with merged_for_rollout(model) as merged:
            outputs[name] = engine.generate(merged, prompts, mask, params).responses
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    import copy

    plain = copy.deepcopy(model).merge_and_unload()
    reference = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2)).generate(
        plain, prompts, mask, params
    )
    assert torch.equal(outputs["klppo"], reference.responses)
    assert torch.equal(outputs["hf"], reference.responses)


@pytest.mark.slow
def test_critic_lora_and_starting_from_a_saved_adapter(tiny_model_dir, arithmetic_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from klppo.models.lora import apply_lora

    # a saved adapter with non-zero B: the run must start from it (the actor differs from the reference)
    torch.manual_seed(0)
    seeded = apply_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), rank=4, alpha=8, target_modules="all-linear"
    )
    for name, p in seeded.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3)
    seeded.save_pretrained(tmp_path / "adapter")

    reward_fn = tmp_path / "reward.py"  # non-zero returns, so the critic gets a gradient
    reward_fn.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    return 1.0 + len(solution_str) / 10.0\n"
    )
    run = tmp_path / "run"
    overrides = (
        base_overrides(tiny_model_dir, arithmetic_data, run)
        + LORA
        + [
            f"custom_reward_function.path={reward_fn}",
            f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}",
            "algorithm.adv_estimator=gae",
            "critic.model.lora_rank=4",
            "critic.model.lora_alpha=8",
            "trainer.save_freq=1",
            "trainer.total_training_steps=1",
        ]
    )
    _, built = run_training(overrides)
    (row,) = read_metrics(run)
    assert abs(row["actor/ref_kl_k1"]) > 1e-4  # the loaded adapter moved the policy away from the base
    critic_trainable = {n for n, p in built.roles.critic.model.named_parameters() if p.requires_grad}
    assert critic_trainable and all("lora_" in n or "score" in n for n in critic_trainable)
    assert any("score" in n for n in critic_trainable)  # the value head trains in full
    assert row["critic/grad_norm"] > 0

    from klppo.commands.export import main as export_main

    assert export_main([str(run / "global_step_1"), str(tmp_path / "critic_hf"), "--role", "critic"]) == 0
    from transformers import AutoModelForTokenClassification

    exported = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic_hf")
    assert not any("lora" in k for k in exported.state_dict())


@pytest.fixture
def gpu_mixed_precision(monkeypatch):
    """The trainer's FSDP settings as on a GPU (bf16 compute, fp32 master weights, fp32 gradient reduce),
    on CPU: ``fsdp_settings`` picks mixed precision only for ``device_type == 'cuda'``."""
    from klppo.assembly import roles_build, settings

    real = settings.fsdp_settings

    def as_on_gpu(fsdp, *, device_type, world_size, **kwargs):
        return real(fsdp, device_type="cuda", world_size=world_size, **kwargs)

    monkeypatch.setattr(roles_build, "fsdp_settings", as_on_gpu)  # every role's, the actor's included


@pytest.mark.slow
@pytest.mark.parametrize("path", ["fsdp2", "plain"])
def test_lora_under_gpu_mixed_precision_trains_saves_and_resumes(
    path, gpu_mixed_precision, tiny_model_dir, arithmetic_data, tmp_path
):
    """Issue 16's crash (bf16 gradients assigned to the fp32 adapters in the first update, when the
    reference with adapters off ran first) on CPU with the GPU's FSDP settings, through the trainer: GRPO +
    MSE KL loss (old-log-prob pass skipped), the klppo engine on merged gathered weights; adapters, their
    gradients and AdamW state in fp32; base weights untouched; a checkpoint resumes to the uninterrupted
    run's step-2 metrics; the checkpoint exports merged. Under FSDP2, and on the plain path (one process's
    default: the model in bf16, the fp32 adapters its masters, the frozen base weights their own)."""
    from transformers import AutoModelForCausalLM

    from klppo.parallel.fsdp import gathered_params

    gpu = LORA + [
        "actor_rollout_ref.actor.kl_loss_type=mse",
        "actor_rollout_ref.rollout.name=klppo",
        # one mini-batch: on-policy, the reference runs first
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        # a unit per decoder layer, as with several GPUs (one process's default is one unit): the crash's
        # layout
        "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0",
        f"actor_rollout_ref.actor.fsdp_config.plain_single_gpu={path == 'plain'}",
    ]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    _, built = run_training(
        base_overrides(tiny_model_dir, arithmetic_data, full_dir) + gpu + ["trainer.total_training_steps=2"]
    )
    full = read_metrics(full_dir)
    model, optimizer = built.roles.actor.model, built.roles.actor.optimizer
    assert built.roles.reference.model is model
    assert "old_log_prob" not in " ".join(full[0])  # no old-log-prob pass (π_old = the update's own)
    if path == "fsdp2":
        group = model.get_base_model().model.layers[0]._get_fsdp_state()._fsdp_param_group
        assert group.mp_policy.param_dtype == torch.bfloat16  # the GPU's settings were in force
    else:
        assert built.roles.actor.masters is not None
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # the GPU's compute dtype
    weights = built.roles.actor.state_model  # FSDP2: the model's sharded parameters; plain: the masters
    assert all(
        row["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(row["actor/pg_loss"])) for row in full
    )
    adapters = [p for n, p in weights.named_parameters() if "lora_" in n]
    assert adapters and all(p.requires_grad and p.dtype == torch.float32 for p in adapters)
    assert all(p.grad.dtype == torch.float32 for p in adapters)
    for p in adapters:
        state = optimizer.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    with gathered_params(model):
        q = model.get_base_model().model.layers[0].self_attn.q_proj
        assert q.lora_B["default"].weight.abs().max() > 0  # the adapter learned something
    masters = {n: getattr(p, "full_tensor", p.detach)() for n, p in weights.named_parameters()}
    base_key = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    base = masters[base_key]  # FSDP2: the fp32 master; plain: the bf16 compute copy, its own master
    assert base.dtype == (torch.float32 if path == "fsdp2" else torch.bfloat16)
    assert torch.equal(base, original["model.layers.0.self_attn.q_proj.weight"].to(base.dtype))

    cut = base_overrides(tiny_model_dir, arithmetic_data, cut_dir) + gpu
    run_training(cut + ["trainer.total_training_steps=1", "trainer.save_freq=1"])
    assert (cut_dir / "global_step_1" / "COMPLETE").exists()
    state, _ = run_training(cut + ["trainer.total_training_steps=2"])
    assert state.global_step == 2
    resumed = {row["step"]: row for row in read_metrics(cut_dir)}
    compared = (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "response_length/mean",
        "critic/score/mean",
    )
    for key in compared:
        assert resumed[2][key] == pytest.approx(full[1][key], rel=1e-5, abs=1e-6), key

    from klppo.commands.export import main as export_main

    out = tmp_path / "hf"
    assert export_main([str(cut_dir / "global_step_1"), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert not any("lora" in k for k in exported)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert exported[key].dtype == torch.float32 and not torch.equal(exported[key], original[key])


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: getattr(p, "full_tensor", p.detach)().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_lora_on_the_plain_path_equals_fsdp2_on_one_process(
    gpu_mixed_precision, tiny_model_dir, arithmetic_data, tmp_path
):
    """A frozen weight's compute copy is its own master on the plain path (no fp32 copy of a LoRA model's
    base): three steps of a LoRA actor and a LoRA critic under the GPU's mixed precision give FSDP2's
    metrics and trained weights on one process bit for bit, and the frozen weights FSDP2 computes with; the
    plain path's masters hold the trained parameters only. The step-2 checkpoint of each path (the critic's
    holds its base: bf16 from the plain path, fp32 from FSDP2) resumes on the other to the same step 3, and
    the plain path's critic exports."""
    common = LORA + [
        "actor_rollout_ref.rollout.name=klppo",
        "algorithm.adv_estimator=gae",
        "critic.model.lora_rank=4",
        "critic.model.lora_alpha=8",
        "trainer.save_freq=2",
        "trainer.total_training_steps=3",
        "trainer.allow_resume_changes=True",
    ]

    def overrides(path: str, run_dir: Path) -> list[str]:
        flag = f"={path == 'plain'}"
        return (
            base_overrides(tiny_model_dir, arithmetic_data, run_dir)
            + common
            + [
                "actor_rollout_ref.actor.fsdp_config.plain_single_gpu" + flag,
                "critic.model.fsdp_config.plain_single_gpu" + flag,
            ]
        )

    def steps(run_dir: Path) -> list[dict]:
        return [
            {k: v for k, v in row.items() if not k.startswith(("timing", "perf/")) and not k.endswith("_s")}
            for row in read_metrics(run_dir)
        ]

    metrics, weights = {}, {}
    for path in ("fsdp2", "plain"):
        _, built = run_training(overrides(path, tmp_path / path))
        roles = (built.roles.actor, built.roles.critic)
        if path == "plain":
            for role in roles:
                ms = role.masters
                trained = [p for p in ms.params if p.requires_grad]
                assert 0 < len(trained) < len(ms.params)
                kept = [m for p, m in zip(ms.params, ms.masters) if m is not p]
                assert sum(m.numel() * m.element_size() for m in kept) == 4 * sum(p.numel() for p in trained)
                assert all(p.dtype == torch.bfloat16 for p in ms.params)
        metrics[path] = steps(tmp_path / path)
        weights[path] = [_weights(role.state_model) for role in roles]
    assert len(metrics["plain"]) == 3 and metrics["plain"] == metrics["fsdp2"]
    assert all(row["actor/grad_norm"] > 0 and row["critic/grad_norm"] > 0 for row in metrics["plain"])
    for plain, fsdp2 in zip(weights["plain"], weights["fsdp2"], strict=True):
        assert plain.keys() == fsdp2.keys()
        for key, value in plain.items():
            assert torch.equal(value, fsdp2[key].to(value.dtype)), key
            assert value.dtype == (torch.float32 if fsdp2[key].requires_grad else torch.bfloat16), key

    import shutil

    from klppo.parallel.checkpoint import SafeFileSystemReader

    for path, dtype in (("plain", torch.bfloat16), ("fsdp2", torch.float32)):
        saved = SafeFileSystemReader(tmp_path / path / "global_step_2" / "critic").read_metadata()
        base = [v for k, v in saved.state_dict_metadata.items() if k.endswith("q_proj.base_layer.weight")]
        assert base and all(v.properties.dtype == dtype for v in base), path
    for written, resumed in (("plain", "fsdp2"), ("fsdp2", "plain")):
        run_dir = tmp_path / f"{written}_to_{resumed}"
        shutil.copytree(tmp_path / written / "global_step_2", run_dir / "global_step_2")
        run_training(overrides(resumed, run_dir))
        assert steps(run_dir) == metrics[resumed][2:], (written, resumed)

    # the plain path's critic checkpoint (a bf16 base) exports merged
    from transformers import AutoModelForTokenClassification

    from klppo.commands.export import main as export_main

    out = tmp_path / "critic_hf"
    assert export_main([str(tmp_path / "plain" / "global_step_2"), str(out), "--role", "critic"]) == 0
    exported = AutoModelForTokenClassification.from_pretrained(out).state_dict()
    assert exported and not any("lora" in k for k in exported)
