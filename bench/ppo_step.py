"""One KL-PPO step's timing breakdown on a Qwen2.5-0.5B-shaped random model (issue 4 / issue 6 figure).

train_batch_size 16 prompts × n 4 = 64 samples, prompts of 256 tokens, responses of 256 tokens forced
(``rollout.ignore_eos``: random weights never emit EOS), GAE with a critic, KL in the reward and a KL loss
(policy, reference and critic, like TRL's PPO), one PPO epoch in 4 mini-batches. Runs the trainer in
this process for ``--steps`` steps per rollout backend and reports the last step (the first includes
warm-up: allocator growth, CUDA-graph capture).

    PYTHONPATH=$PWD python3 bench/ppo_step.py --rollouts klppo hf --out $OUT/ppo_step.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

QWEN25_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


def make_model_dir(root: Path, shape: dict) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from klppo.models.tiny import build_tiny_tokenizer

    path = root / "qwen2.5-0.5b-random"
    config = AutoConfig.for_model("qwen2", bos_token_id=1, eos_token_id=2, pad_token_id=2, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


def make_prompts(root: Path, tokenizer_dir: Path, *, prompt_len: int, rows: int) -> Path:
    """GSM8K-schema rows whose chat-templated prompt is exactly ``prompt_len`` tokens."""
    from transformers import AutoTokenizer

    from klppo.data.gsm8k import make_row, write_rows

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)

    def length(k: int) -> int:
        msgs = [{"role": "user", "content": "7 " * k}]
        return len(
            tok(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))["input_ids"]
        )

    k = next(k for k in range(prompt_len) if length(k) >= prompt_len)
    rows_ = [make_row(question="7 " * k, answer="#### 7", split="train", index=i) for i in range(rows)]
    rows_ = [dict(r, prompt=[{"role": "user", "content": "7 " * k}]) for r in rows_]
    out = root / "prompts.parquet"
    write_rows(rows_, out)
    return out


def run(model_dir: Path, data: Path, run_dir: Path, *, rollout: str, steps: int, args) -> dict:
    import torch

    from klppo.config import load_config
    from klppo.parallel import dist
    from klppo.trainer.ppo_trainer import PPOTrainer
    from klppo.trainer.setup import build_run

    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={args.prompt_len}",
        f"data.max_response_length={args.response_len}",
        "data.filter_overlong_prompts=False",
        "data.truncation=left",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.rollout.name={rollout}",
        "actor_rollout_ref.rollout.ignore_eos=True",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts // 4}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "critic.forward_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "critic.model.enable_gradient_checkpointing=False",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        f"trainer.device={args.device}",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={run_dir}",
    ]
    cfg = load_config(overrides)
    info = dist.init_distributed(args.device, 600.0)
    try:
        start = time.perf_counter()
        built = build_run(cfg, device=info.device, argv=overrides)
        setup_s = time.perf_counter() - start  # with rollout=klppo the decode functions compile meanwhile
        PPOTrainer(built).fit()
    finally:
        dist.destroy()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    del built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"rollout": rollout, "setup_s": setup_s, "steps": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", nargs="+", default=["klppo", "hf"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--out", default="ppo_step.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--tiny", action="store_true", help="a 2-layer model instead of the 0.5B shape (smoke test)"
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="klppo_bench_"))
    shape = (
        dict(
            QWEN25_05B,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=384,
        )
        if args.tiny
        else QWEN25_05B
    )
    model_dir = make_model_dir(root, shape)
    data = make_prompts(root, model_dir, prompt_len=args.prompt_len, rows=args.prompts * args.steps)
    results = []
    for rollout in args.rollouts:
        res = run(model_dir, data, root / f"run_{rollout}", rollout=rollout, steps=args.steps, args=args)
        last = res["steps"][-1]
        keys = sorted(k for k in last if k.startswith(("timing_s/", "perf/")))
        first = res["steps"][0]
        print(f"== rollout={rollout}: setup {res['setup_s']:.2f} s, first step gen {first['timing_s/gen']:.2f} s "
              f"(update_weights {first.get('timing_s/update_weights', 0.0):.2f} s)")  # fmt: skip
        print(f"== rollout={rollout}: step {last['step']} of {args.steps}")
        for k in keys:
            print(f"   {k:40s} {last[k]:.4f}")
        results.append(res)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
