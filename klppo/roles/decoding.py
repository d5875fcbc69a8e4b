"""Response texts from token ids: :func:`decode_batch`, shared by the reward role and its background
scoring process (:mod:`klppo.roles.reward_worker`)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast  # transformers 5: TokenizersBackend, the same class


def decode_batch(tokenizer, rows: list[list[int]]) -> list[str]:
    """``[tokenizer.decode(r, skip_special_tokens=True) for r in rows]``, in one call of the Rust backend's
    multi-threaded ``decode_batch`` where that gives the same text: a fast tokenizer class that overrides
    neither ``decode`` nor ``_decode`` (Whisper, CodeGen, … do) and cleans up no spaces in Python. A
    per-row loop is a large share of a small model's reward phase, with the GPU idle meanwhile."""
    if _backend_decodes_alike(tokenizer):
        return tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=True)
    return [tokenizer.decode(r, skip_special_tokens=True) for r in rows]


def _backend_decodes_alike(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` is the Rust backend's decode and nothing more (see
    :func:`decode_batch`)."""
    if getattr(tokenizer, "backend_tokenizer", None) is None or getattr(
        tokenizer, "clean_up_tokenization_spaces", True
    ):
        return False
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls._decode is PreTrainedTokenizerFast._decode
        and cls.decode is PreTrainedTokenizerFast.decode
    )
