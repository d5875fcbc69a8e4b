"""load_causal_lm / load_critic / load_reward_model on tiny model directories."""

from __future__ import annotations

import pytest
import torch

from klppo.models.loading import (
    ModelLoadError,
    is_activation_checkpointing,
    load_causal_lm,
    load_critic,
    load_reward_model,
    load_tokenizer,
)
from klppo.models.tiny import build_tiny_model, build_tiny_tokenizer, end_turns_early, save_tiny_model_dir

IDS = torch.tensor([[5, 17, 40, 3, 99, 7], [8, 9, 10, 11, 12, 2]])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", seed=3)


def _reference_model():
    return build_tiny_model(arch="qwen2", seed=3, vocab_size=len(build_tiny_tokenizer()))


def test_causal_lm_round_trip(tiny_dir):
    model = load_causal_lm(str(tiny_dir), dtype=torch.float32)
    reference = _reference_model()
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)
    assert model.dtype == torch.float32 and not is_activation_checkpointing(model)
    bf16 = load_causal_lm(str(tiny_dir), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def test_causal_lm_options(tiny_dir):
    model = load_causal_lm(
        str(tiny_dir),
        dtype=torch.float32,
        gradient_checkpointing=True,
        attn_implementation="eager",
        override_config={"attention_dropout": 0.25},
    )
    assert is_activation_checkpointing(model) and model.config.use_cache is False
    assert model.config.attention_dropout == 0.25
    assert model.config._attn_implementation == "eager"
    model.train()
    loss = model(IDS, labels=IDS).loss
    loss.backward()  # checkpointed backward runs and reaches the embeddings
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


def test_hub_id_loads_from_fake_cache(tiny_dir, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--tiny--qwen2" / "snapshots" / "deadbeef"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(tiny_dir, target_is_directory=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = load_causal_lm("tiny/qwen2", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, _reference_model()(IDS).logits)
    assert load_tokenizer("tiny/qwen2").eos_token == "<|im_end|>"


def test_critic_from_causal_lm_dir(tiny_dir, tmp_path):
    critic = load_critic(str(tiny_dir), dtype=torch.float32)
    reference = _reference_model()
    # backbone = the causal LM's backbone, exactly
    ref_state = reference.model.state_dict()
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    assert torch.count_nonzero(critic.score.weight) == 0 and torch.count_nonzero(critic.score.bias) == 0
    critic.train()  # no dropout on the head: values are deterministic in train mode too
    values = critic(IDS).logits
    assert values.shape == (2, 6, 1) and torch.count_nonzero(values) == 0
    # a trained head survives save/load (not reset to zero)
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
        critic.score.bias.fill_(0.5)
    critic.save_pretrained(tmp_path / "critic")
    build_tiny_tokenizer().save_pretrained(tmp_path / "critic")
    again = load_critic(str(tmp_path / "critic"), dtype=torch.float32)
    assert torch.equal(again.score.weight, critic.score.weight) and again.score.bias.item() == 0.5
    with torch.no_grad():
        assert torch.allclose(again(IDS).logits, critic(IDS).logits)


def test_reward_model(tiny_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="not a trained reward model"):
        load_reward_model(str(tiny_dir), dtype=torch.float32)
    from transformers import AutoModelForSequenceClassification

    config = _reference_model().config
    config.num_labels = 1
    torch.manual_seed(1)
    trained = AutoModelForSequenceClassification.from_config(config).eval()
    trained.save_pretrained(tmp_path / "rm")
    build_tiny_tokenizer().save_pretrained(tmp_path / "rm")
    rm = load_reward_model(str(tmp_path / "rm"), dtype=torch.float32, pad_token_id=0)
    assert not rm.training and rm.config.pad_token_id == 0
    trained.config.pad_token_id = None
    trained.save_pretrained(tmp_path / "rm")
    rm = load_reward_model(str(tmp_path / "rm"), dtype=torch.float32)
    assert rm.config.pad_token_id == 2  # from the tokenizer next to it
    trained.config.pad_token_id = 2
    ids = torch.tensor([[5, 17, 40, 3], [8, 9, 2, 2]])  # second row right-padded with pad = 2
    with torch.no_grad():
        scores = rm(ids).logits
        assert scores.shape == (2, 1)
        assert torch.allclose(scores, trained(ids).logits)
        # the padded row is scored at its last real token
        assert torch.allclose(scores[1], trained(ids[1:, :2]).logits[0], atol=1e-5)


def test_a_tiny_model_can_end_its_turns_early(tmp_path):
    """``eos_logit``: greedy decoding ends the turn at once and sampling after a few tokens, whatever the
    prompt (what the CPU runs of multi-turn rollouts need to see a second turn); the directory loads."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model_dir(tmp_path / "m", eos_logit=3.0)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = build_tiny_tokenizer()
    for text in ("What is 12 + 7?", "Natalia sold clips"):
        ids = tok(text, return_tensors="pt")["input_ids"]
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        assert greedy[0, ids.shape[1]].item() == tok.eos_token_id
    torch.manual_seed(0)
    sampled = model.generate(
        ids.repeat(32, 1),
        attention_mask=torch.ones_like(ids).repeat(32, 1),
        max_new_tokens=40,
        do_sample=True,
    )
    ended = (sampled[:, ids.shape[1] :] == tok.eos_token_id).any(dim=1)
    assert ended.float().mean() > 0.9
    with pytest.raises(ValueError, match="untied LM head"):
        end_turns_early(build_tiny_model(), eos_logit=3.0)
