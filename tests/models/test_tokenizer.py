"""EOS / pad fixing from the chat template, and the set of ids that end a response."""

from __future__ import annotations

import types

import pytest

from klppo.models.tiny import build_tiny_tokenizer
from klppo.models.tokenizer import chat_end_of_turn_token, eos_token_ids, fix_special_tokens

LLAMA3_LIKE = (
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
)


def _broken_like_gguf_517():
    """The state transformers 5.17's GGUF conversion leaves SmolLM2 in: EOS = <|im_start|>, no pad."""
    tok = build_tiny_tokenizer()
    tok.eos_token = "<|im_start|>"
    tok.pad_token = None
    assert tok.eos_token_id == 1 and tok.pad_token is None
    return tok


def test_end_of_turn_from_chatml_template():
    assert chat_end_of_turn_token(build_tiny_tokenizer()) == "<|im_end|>"


def test_fix_replaces_turn_opening_eos_and_sets_pad():
    tok = fix_special_tokens(_broken_like_gguf_517())
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token, tok.pad_token_id) == ("<|im_end|>", 2)


def test_fix_fills_missing_eos_and_keeps_a_correct_one():
    tok = build_tiny_tokenizer()
    tok.eos_token = None
    tok.pad_token = None
    assert fix_special_tokens(tok).eos_token == "<|im_end|>"
    good = build_tiny_tokenizer()
    good.pad_token = "<|endoftext|>"
    fix_special_tokens(good)
    assert (good.eos_token, good.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_base_model_eos_absent_from_template_is_kept():
    # Qwen2.5 base: EOS <|endoftext|>, ChatML template. The template does not use EOS: keep it.
    tok = build_tiny_tokenizer()
    tok.eos_token = "<|endoftext|>"
    tok.pad_token = None
    fix_special_tokens(tok)
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"


def test_no_template_falls_back_to_config_eos():
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    tok.eos_token = None
    tok.pad_token = None
    assert chat_end_of_turn_token(tok) is None
    fix_special_tokens(tok, config_eos_token_id=[0, 2])
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|endoftext|>"


def test_llama3_like_template():
    tok = build_tiny_tokenizer()
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}
    )
    tok.chat_template = LLAMA3_LIKE
    assert chat_end_of_turn_token(tok) == "<|eot_id|>"
    tok.eos_token = "<|endoftext|>"
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    generation = types.SimpleNamespace(eos_token_id=[0, eot])
    assert eos_token_ids(tok, generation_config=generation) == sorted({0, eot})


def test_eos_ids_union_without_turn_opener():
    tok = _broken_like_gguf_517()
    config = types.SimpleNamespace(eos_token_id=2)
    # even unfixed, the turn-opening <|im_start|> (id 1) is never an end-of-response id
    assert eos_token_ids(tok, config) == [2]
    generation = types.SimpleNamespace(eos_token_id=[1, 0])
    assert eos_token_ids(fix_special_tokens(tok), config, generation) == [0, 2]


def test_eos_ids_none_raises():
    tok = build_tiny_tokenizer()
    tok.chat_template = None
    tok.eos_token = None
    with pytest.raises(ValueError, match="no EOS"):
        eos_token_ids(tok, types.SimpleNamespace(eos_token_id=None))
