"""Tokenizer loading with the special tokens a PPO run relies on: an EOS that ends a response, a pad.

The chat template is the ground truth for what ends an assistant turn: we render a two-message
conversation with a marker as the assistant's content and read the special token that follows the marker
(``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``</s>`` for Mistral). That token fixes a broken
EOS: transformers' GGUF conversion (seen with 5.17 on SmolLM2) labels ``<|im_start|>`` as EOS and sets no
pad, and a policy whose EOS is the turn *opener* never stops generating.

Rules (`fix_special_tokens`), applied in order:
1. EOS missing, or EOS used by the template only to *open* turns → EOS := the end-of-turn token
   (else the config's ``eos_token_id``).
2. pad missing → pad := EOS. (So pad may equal EOS: response masks must come from generated positions,
   never from ``!= pad_id``.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_MARK = "KLPPOMARKER7Q"
_USER_MARK = "KLPPOUSER3Z"


def _special_strings(tokenizer) -> list[str]:
    """Special and added tokens, longest first (so ``<|im_end|>`` wins over a prefix of it)."""
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    specials |= set((tokenizer.get_added_vocab() or {}).keys())
    return sorted((s for s in specials if s), key=len, reverse=True)


def _render(tokenizer) -> str | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    msgs = [{"role": "user", "content": _USER_MARK}, {"role": "assistant", "content": _MARK}]
    try:
        text = tokenizer.apply_chat_template(msgs, tokenize=False)
    except Exception:  # templates may refuse unusual conversations: then there is no evidence
        return None
    return text if isinstance(text, str) and _MARK in text else None


def chat_end_of_turn_token(tokenizer) -> str | None:
    """The special token the chat template writes right after an assistant message, or None."""
    text = _render(tokenizer)
    if text is None:
        return None
    after = text.split(_MARK, 1)[1].lstrip(" ")
    for special in _special_strings(tokenizer):
        if after.startswith(special):
            return special
    return None


def _opens_turns_only(tokenizer, token: str) -> bool:
    """True when the rendered conversation uses ``token`` but never right after a message's content."""
    text = _render(tokenizer)
    if text is None or token not in text:
        return False
    after_content = text.split(_MARK, 1)[1].lstrip(" ").startswith(token)
    return not after_content and not text.split(_USER_MARK, 1)[1].lstrip(" ").startswith(token)


def fix_special_tokens(tokenizer, *, config_eos_token_id: int | list[int] | None = None):
    """Make EOS the token that ends a response and set pad (see the module rules). Mutates; returns it."""
    eos = tokenizer.eos_token
    if eos is None or _opens_turns_only(tokenizer, eos):
        end_of_turn = chat_end_of_turn_token(tokenizer)
        if end_of_turn is None and config_eos_token_id is not None:
            first = config_eos_token_id[0] if isinstance(config_eos_token_id, list) else config_eos_token_id
            end_of_turn = tokenizer.convert_ids_to_tokens(int(first))
        if end_of_turn is not None and end_of_turn != eos:
            tokenizer.eos_token = end_of_turn
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(tokenizer, model_config: Any = None, generation_config: Any = None) -> list[int]:
    """All token ids that end a response, sorted and deduplicated.

    Union of the tokenizer's EOS, the chat template's end-of-turn token, and ``eos_token_id`` of the
    generation config (Llama 3 lists several there) — or of the model config when no generation config is
    given. The token the template uses to *open* turns is never included, even if a config names it.
    """
    ids: set[int] = set(_as_id_list(tokenizer.eos_token_id))
    end_of_turn = chat_end_of_turn_token(tokenizer)
    if end_of_turn is not None:
        ids.add(int(tokenizer.convert_tokens_to_ids(end_of_turn)))
    source = generation_config if generation_config is not None else model_config
    ids |= set(_as_id_list(getattr(source, "eos_token_id", None)))
    for token_id in list(ids):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is not None and _opens_turns_only(tokenizer, token):
            ids.discard(token_id)
    if not ids:
        raise ValueError("the tokenizer and configs name no EOS token: a response could never end")
    return sorted(ids)


def load_tokenizer(path: str, *, trust_remote_code: bool = False, gguf_file: str | None = None):
    """Load a tokenizer from a model directory (or a directory + ``gguf_file``) and fix EOS / pad.

    Returns a `PreTrainedTokenizerBase` whose ``eos_token`` ends an assistant response and whose
    ``pad_token`` is set (pad = EOS when the checkpoint names none). Padding side is left as the
    checkpoint has it; rollout code sets it. Use `klppo.models.loading.load_tokenizer` for user paths
    (hub ids, `.gguf` files): it resolves them and then calls this.
    """
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415  heavy (transformers, ~2 s): only when a tokenizer loads

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    config_eos = None
    if gguf_file is not None or (Path(path) / "config.json").is_file():
        try:
            config_eos = getattr(AutoConfig.from_pretrained(path, **kwargs), "eos_token_id", None)
        except (OSError, ValueError):
            config_eos = None
    return fix_special_tokens(tokenizer, config_eos_token_id=config_eos)
