"""Tiny models and tokenizers built on the spot, for tests and offline demos.

Nothing here touches the network: the tokenizer is a byte-level BPE trained in a fraction of a second on a
small built-in corpus, and the model is a randomly initialised Qwen2- or Llama-shaped causal LM built from a
config. ``save_tiny_model_dir`` writes both as a normal Hugging Face directory, so the real loading code is
exercised on it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    'What is 12 plus 7? Let\'s think step by step and output the final answer after "####".',
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "The answer is 42. #### 42",
    "user assistant system",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000 + - * / = $ , . ? !",
    "How many apples does she have left? She has 3 apples. #### 3",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
]


def build_tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer with ChatML special tokens (ids 0, 1, 2) and a chat template.

    eos = pad = ``<|im_end|>`` (id 2), as SmolLM2-Instruct has it: response masks must not be derived
    from ``!= pad_id``.
    """

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "left"
    return fast


def build_tiny_model(
    *,
    arch: str = "qwen2",
    vocab_size: int = 384,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
):
    """A random causal LM of the Llama family (``arch`` ∈ qwen2, llama, mistral, qwen3)."""

    model_type = {"qwen2": "qwen2", "llama": "llama", "mistral": "mistral", "qwen3": "qwen3"}[arch]
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if model_type == "qwen3":
        config.head_dim = hidden_size // num_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    return model


def end_turns_early(model, *, eos_logit: float, seed: int = 1) -> None:
    """Make a tiny Qwen2 model end its turns after a few sampled tokens (greedy: at once), so that its
    conversations have several turns. The last layer's attention adds one fixed vector to every position
    (value weights zero and value bias one, so each head's output is the bias whatever the attention
    weights; the output projection maps it onto a random unit direction), and the LM head's EOS row points
    along that direction: the EOS logit is about ``eos_logit`` at every position, whatever the input. Needs
    an untied LM head (a tied one's EOS row is the padding embedding, zero)."""
    attn, head = model.model.layers[-1].self_attn, model.get_output_embeddings()
    if attn.v_proj.bias is None or head.weight is model.get_input_embeddings().weight:
        raise ValueError("end_turns_early needs value biases (Qwen2) and an untied LM head")
    hidden = model.config.hidden_size
    direction = torch.randn(hidden, generator=torch.Generator().manual_seed(seed))
    direction /= direction.norm()
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        attn.v_proj.weight.zero_()
        attn.v_proj.bias.fill_(1.0)
        width = attn.o_proj.weight.shape[1]
        # 10× the unit vector: it dominates the residual stream, so the final norm leaves it at ~sqrt(hidden)
        attn.o_proj.weight.copy_(10.0 * torch.outer(direction, torch.ones(width)) / width)
        head.weight[eos] = direction * eos_logit / hidden**0.5


def save_tiny_model_dir(path: str | Path, *, eos_logit: float | None = None, **model_kwargs) -> Path:
    """Write a tiny model and its tokenizer as a Hugging Face directory; returns the path. ``eos_logit``:
    a model whose turns end early (:func:`end_turns_early`; its LM head untied)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(model_kwargs.get("vocab_size", 384))
    model_kwargs.setdefault("vocab_size", len(tokenizer))
    if eos_logit is not None:
        model_kwargs["tie_word_embeddings"] = False
    model = build_tiny_model(**model_kwargs)
    if eos_logit is not None:
        end_turns_early(model, eos_logit=eos_logit)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
