"""Padding-free forward passes: pack a micro-batch into one row, run the model, unpack per token.

Layout (verl's): ``input_ids`` [B, L] = prompt (left-padded) followed by response (right-padded),
``L = P + R``; ``attention_mask`` [B, L] marks real tokens, which form one contiguous run per row.
Response token ``j`` of row ``b`` sits at column ``L - R + j`` and is predicted by the output at column
``L - R - 1 + j``: log-probs and values are read there (values = critic output at ``[:, -R-1:-1]``).

Packing keeps only the real tokens: ``input_ids`` [1, T] with ``T = Σ mask``, ``position_ids`` restarting
at each sequence (gathered from the padded position ids), ``cu_seqlens`` [B+1] sequence boundaries and
``indices`` [T] (flat positions in ``B × L``) to scatter per-token results back. The attention is
block-diagonal causal (see :mod:`klppo.batching.attention`), so each sequence sees exactly the tokens it
sees in the padded forward and results agree up to float rounding. A model whose decoder layers are
compiled (:mod:`klppo.models.compiled_layers`) runs its packed row unpadded (dynamic token dims).

Both paths return zeros at masked response positions. Log-probs and entropy are float32 (logits are
upcast before the softmax); gradients flow through them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import numpy as np
import torch

from klppo.algorithms.losses import entropy_from_logits
from klppo.batching.attention import PACKED_ATTENTION
from klppo.models import lm_head
from klppo.models.lm_head import stats_compiled, token_stats_head


@dataclasses.dataclass
class Packed:
    """One packed row. ``indices[k]`` = flat index ``b * L + l`` of packed token ``k``."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    cu_seqlens: torch.Tensor  # [B+1] int32
    max_seqlen: int
    indices: torch.Tensor  # [T] int64
    batch_size: int
    seq_len: int

    def attention_kwargs(self) -> dict:
        """Keyword arguments that carry the boundaries to the varlen attention (transformers names)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_seqlen,
            "max_length_k": self.max_seqlen,
        }

    def flat_positions(self) -> torch.Tensor:
        """[B, L] packed index of each padded position, -1 on padding."""
        pos = torch.full((self.batch_size * self.seq_len,), -1, dtype=torch.long, device=self.indices.device)
        pos[self.indices] = torch.arange(self.indices.numel(), device=self.indices.device)
        return pos.view(self.batch_size, self.seq_len)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device`` without waiting for the device (an asynchronous copy: a
    blocking host→device copy would synchronise the stream)."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    *,
    host_mask: np.ndarray | None = None,
) -> Packed:
    """Remove padding: [B, L] → one row [1, T] (row-major order of the real tokens).

    ``position_ids`` defaults to ``cumsum(mask) - 1`` per row (0 at each sequence's first token).
    ``host_mask``: a numpy copy of ``attention_mask``; the token positions are then found on the host
    (no device sync) and copied to the device asynchronously. Same result either way.
    """
    batch_size, seq_len = input_ids.shape
    mask = attention_mask.bool()
    if position_ids is None:
        position_ids = (mask.long().cumsum(dim=1) - 1).clamp(min=0)
    if host_mask is not None:
        host_lengths = host_mask.sum(axis=1, dtype=np.int32)
        indices = to_device(np.flatnonzero(host_mask.reshape(-1)).astype(np.int64), input_ids.device)
        cu_seqlens = to_device(
            np.concatenate([[0], np.cumsum(host_lengths)]).astype(np.int32), input_ids.device
        )
        max_seqlen = int(host_lengths.max()) if batch_size else 0
    else:
        indices = torch.nonzero(mask.reshape(-1), as_tuple=False).squeeze(-1)
        lengths = mask.sum(dim=1, dtype=torch.int32)
        cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        max_seqlen = int(lengths.max()) if batch_size else 0
    return Packed(
        input_ids=input_ids.reshape(-1)[indices].unsqueeze(0),
        position_ids=position_ids.reshape(-1)[indices].unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        indices=indices,
        batch_size=batch_size,
        seq_len=seq_len,
    )


def unpack(
    values: torch.Tensor, packed: Packed, batch_size: int | None = None, seq_len: int | None = None
) -> torch.Tensor:
    """[1, T, ...] or [T, ...] per-token values → [B, L, ...] with zeros on padding (differentiable)."""
    batch_size = packed.batch_size if batch_size is None else batch_size
    seq_len = packed.seq_len if seq_len is None else seq_len
    if values.dim() >= 2 and values.shape[0] == 1 and values.shape[1] == packed.indices.numel():
        values = values.squeeze(0)
    out = values.new_zeros((batch_size * seq_len, *values.shape[1:]))
    out = out.index_put((packed.indices,), values)
    return out.view(batch_size, seq_len, *values.shape[1:])


def trim_padding_columns(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    response_length: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Drop the columns that are padding in every row: prompt columns on the left, response on the right.

    Returns ``(input_ids, attention_mask, position_ids, R')``; results of the trimmed batch for response
    columns ``[0, R')`` are those of the full batch, the columns ``[R', R)`` are all padding (pad them back
    with zeros). Lets a padded micro-batch cost its own longest prompt + response, not the batch's.
    """
    prompt_width = attention_mask.shape[1] - response_length
    real = attention_mask.bool()
    prompt_cols = real[:, :prompt_width].any(dim=0).nonzero()
    response_cols = real[:, prompt_width:].any(dim=0).nonzero()
    start = int(prompt_cols[0]) if prompt_cols.numel() else prompt_width
    new_r = int(response_cols[-1]) + 1 if response_cols.numel() else 0
    end = prompt_width + new_r
    pos = None if position_ids is None else position_ids[:, start:end]
    return input_ids[:, start:end], attention_mask[:, start:end], pos, new_r


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    *,
    compile_stats: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(z / temperature)[label] as gather − logsumexp (no [N, V] log-softmax kept), and H.
    ``compile_stats``: without autograd (the no-grad passes), by the compiled
    :func:`klppo.models.lm_head.chunk_stats` (one or two passes over the logits instead of eight)."""
    if compile_stats and not (torch.is_grad_enabled() and logits.requires_grad):
        _, log_probs, entropy = lm_head.compiled(lm_head.chunk_stats)(
            logits, labels, temperature, calculate_entropy
        )
        return log_probs, entropy if calculate_entropy else None
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    log_probs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    entropy = entropy_from_logits(z) if calculate_entropy else None  # in row chunks, −Σ p log p
    return log_probs, entropy


def _response_columns(attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """[B, R] bool: response token j of row b is real (its log-prob / value is wanted)."""
    return attention_mask[:, attention_mask.shape[1] - response_length :].bool()


def _scatter_response(
    values: torch.Tensor, target: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """values [N] at the True entries of target [B, R] → [B, R], zeros elsewhere. ``index``: the flat
    positions of those entries (row-major), when known: no device sync for the boolean mask."""
    if index is None:
        return values.new_zeros(target.shape).index_put((target,), values)
    return values.new_zeros(target.numel()).index_put((index,), values).view(target.shape)


def _packed_sources(packed: Packed, target: torch.Tensor) -> torch.Tensor:
    """Packed indices of the positions predicting each real response token (row-major over target)."""
    seq_len, response_length = packed.seq_len, target.shape[1]
    flat = packed.flat_positions()[:, seq_len - response_length - 1 : seq_len - 1]
    src = flat[target]
    if bool((src < 0).any()):
        raise ValueError(_FOLLOWS_PADDING)
    return src


_FOLLOWS_PADDING = "a response token follows a padding position: real tokens must be contiguous per row"


def _host_sources(host_mask: np.ndarray, response_length: int, device: torch.device):
    """:func:`_packed_sources` from the host mask, and the flat positions of the real response tokens in
    [B, R] (row-major); both on ``device``, no device sync."""
    host_mask = np.asarray(host_mask, dtype=bool)
    batch_size, seq_len = host_mask.shape
    flat = host_mask.reshape(-1)
    positions = np.full(flat.shape[0], -1, dtype=np.int64)
    positions[flat] = np.arange(int(flat.sum()), dtype=np.int64)
    target = host_mask[:, seq_len - response_length :]
    src = positions.reshape(batch_size, seq_len)[:, seq_len - response_length - 1 : seq_len - 1][target]
    if (src < 0).any():
        raise ValueError(_FOLLOWS_PADDING)
    return to_device(src, device), to_device(np.flatnonzero(target).astype(np.int64), device)


def _packed_model_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    target: torch.Tensor,
    *,
    response_length: int,
    host_mask: np.ndarray | None,
) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """The rows packed into one: the model's keyword arguments, the packed position before each real
    response token (``src``, row-major over ``target``) and, planned on the host from ``host_mask``, those
    tokens' flat positions in [B, R] (``index``; None without a host mask)."""
    packed = pack(input_ids, attention_mask, position_ids, host_mask=host_mask)
    index = None
    if host_mask is None:
        src = _packed_sources(packed, target)
    else:
        src, index = _host_sources(host_mask, response_length, input_ids.device)
    kwargs = dict(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=None,
        use_cache=False,
        **packed.attention_kwargs(),
    )
    return kwargs, src, index


def _check_attention(model: torch.nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in (PACKED_ATTENTION, "flash_attention_2", "flash_attention_3", "flex_attention"):
        if not getattr(model, "_klppo_warned_packed", False):
            warnings.warn(
                f"packed forward with attn_implementation={impl!r} is correct but attends over a dense "
                "[T, T] mask; call klppo.batching.attention.enable_packed_attention(model) once",
                stacklevel=3,
            )
            model._klppo_warned_packed = True


def _packed_call(model: torch.nn.Module, kwargs: dict) -> dict:
    """A packed forward's keyword arguments as ``model`` runs them: with the klppo_packed attention an empty
    4-D ``attention_mask``, which transformers passes through as "prepared" (its packed-sequence detection
    from ``position_ids`` reads one device scalar per forward); the attention reads ``cu_seq_lens`` only."""
    if getattr(model.config, "_attn_implementation", None) == PACKED_ATTENTION:
        ids = kwargs["input_ids"]
        kwargs = {**kwargs, "attention_mask": torch.ones((1, 1, 0, 0), dtype=torch.bool, device=ids.device)}
    return kwargs


@dataclasses.dataclass
class LogProbInputs:
    """A micro-batch's inputs to :func:`log_probs_of`, prepared once by :func:`prepare_log_probs` (packing,
    label gathering; several device syncs) and reusable by every model that reads the same rows."""

    model_kwargs: dict  # input_ids, position_ids, attention_mask, logits_to_keep (+ packed boundaries)
    target: torch.Tensor  # [B, R] bool: real response tokens
    labels: torch.Tensor  # labels of the kept rows: [N] (packed) or [B, R] (padded)
    head_labels: torch.Tensor  # the same as the LM head sees its rows: [1, N] or [B, R + 1]
    packed: bool
    target_index: torch.Tensor | None = None  # [N] flat positions of target's True entries (host-planned)


def prepare_log_probs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    *,
    response_length: int,
    use_remove_padding: bool,
    host_mask: np.ndarray | None = None,
) -> LogProbInputs:
    """The model inputs of :func:`forward_log_probs` (same arguments), without running a model."""
    target = _response_columns(attention_mask, response_length)
    labels = input_ids[:, input_ids.shape[1] - response_length :]
    if use_remove_padding:
        kwargs, src, index = _packed_model_inputs(
            input_ids,
            attention_mask,
            position_ids,
            target,
            response_length=response_length,
            host_mask=host_mask,
        )
        kept = labels[target] if index is None else labels.reshape(-1)[index]
        kwargs["logits_to_keep"] = src
        return LogProbInputs(kwargs, target, kept, kept.unsqueeze(0), packed=True, target_index=index)
    kwargs = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=response_length + 1,
        use_cache=False,
    )
    # the last kept position predicts nothing: any label (0) there, its result is dropped
    return LogProbInputs(kwargs, target, labels, torch.nn.functional.pad(labels, (0, 1)), packed=False)


def log_probs_of(
    model: torch.nn.Module,
    inputs: LogProbInputs,
    *,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`forward_log_probs` on prepared inputs."""
    if inputs.packed:
        _check_attention(model)
    with _head(model, inputs.head_labels, temperature, calculate_entropy, fused) as head_out:
        out = model(**_packed_call(model, inputs.model_kwargs) if inputs.packed else inputs.model_kwargs)
    target = inputs.target
    if inputs.packed:
        # [N, V] (or [N, 2] fused): only the positions that predict a real response token
        log_probs, entropy = head_out(out.logits[0], inputs.labels)
        log_probs = _scatter_response(log_probs, target, inputs.target_index)
        entropy = None if entropy is None else _scatter_response(entropy, target, inputs.target_index)
        return log_probs, entropy
    log_probs, entropy = head_out(out.logits[:, :-1], inputs.labels)  # from [B, R, V] (or [B, R, 2] fused)
    log_probs = torch.where(target, log_probs, 0.0)
    entropy = None if entropy is None else torch.where(target, entropy, 0.0)
    return log_probs, entropy


def forward_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    *,
    response_length: int,
    temperature: float = 1.0,
    use_remove_padding: bool,
    calculate_entropy: bool = False,
    fused: bool = False,
    host_mask: np.ndarray | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob (and entropy) of each response token under a Hugging Face causal LM.

    Args:
        input_ids, attention_mask, position_ids: [B, L] (layout in the module docstring).
        response_length: R, the last R columns are the response.
        temperature: logits are divided by it (the rollout's sampling temperature).
        use_remove_padding: pack the rows into one (no compute on padding) or run padded.
        calculate_entropy: also return the entropy of the tempered next-token distribution.
        fused: the LM head returns log-prob and entropy directly, computed in chunks of rows
            (:func:`klppo.models.lm_head.token_stats_head`: no [tokens, V] float32 logits); needs a
            float32-output head (:func:`klppo.models.lm_head.fp32_lm_head`).
        host_mask: a numpy copy of ``attention_mask`` (:meth:`klppo.batch.Batch.with_host_mask`): the
            packing is planned on the host, without device syncs. Same results.

    Returns:
        log_probs [B, R] float32 and entropy [B, R] float32 (or None); zeros at masked response positions.
    """
    inputs = prepare_log_probs(
        input_ids,
        attention_mask,
        position_ids,
        response_length=response_length,
        use_remove_padding=use_remove_padding,
        host_mask=host_mask,
    )
    return log_probs_of(
        model, inputs, temperature=temperature, calculate_entropy=calculate_entropy, fused=fused
    )


@contextlib.contextmanager
def _head(model: torch.nn.Module, head_labels: torch.Tensor, temperature: float, entropy: bool, fused: bool):
    """Runs the forward with the fused head when ``fused``; yields how to read (log-prob, entropy) from
    the model's ``logits`` output: ``read(out, labels)``."""
    if not fused:
        fast = stats_compiled(model)
        yield lambda logits, labels: log_probs_from_logits(
            logits, labels, temperature, entropy, compile_stats=fast and lm_head.compiles_on(logits)
        )
        return

    with token_stats_head(model, head_labels, temperature=temperature, with_entropy=entropy):
        yield lambda stats, labels: (stats[..., 0], stats[..., 1] if entropy else None)


def forward_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    *,
    response_length: int,
    use_remove_padding: bool,
    host_mask: np.ndarray | None = None,
) -> torch.Tensor:
    """Critic values [B, R] float32 from a token-classification model with one label.

    The value of response token j is the model's output at the position before it (verl:
    ``logits[:, -R-1:-1]``); zeros at masked response positions. ``host_mask`` as in
    :func:`forward_log_probs`.
    """
    if use_remove_padding:
        _check_attention(model)
        inputs = prepare_values(
            input_ids, attention_mask, position_ids, response_length=response_length, host_mask=host_mask
        )
        return values_of(model, inputs)
    target = _response_columns(attention_mask, response_length)
    out = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    values = out.logits[:, -response_length - 1 : -1, 0].float()
    return torch.where(target, values, 0.0)


@dataclasses.dataclass
class ValueInputs:
    """A packed micro-batch's inputs to :func:`values_of`, prepared by :func:`prepare_values` (the packing and
    the positions to read, planned on the host when a ``host_mask`` is given)."""

    model_kwargs: dict  # input_ids, position_ids, attention_mask=None, use_cache (+ packed boundaries)
    source: torch.Tensor  # [N] packed position whose output is each real response token's value
    target: torch.Tensor  # [B, R] bool: real response tokens
    target_index: torch.Tensor | None = None  # [N] flat positions of target's True entries (host-planned)


def prepare_values(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    *,
    response_length: int,
    host_mask: np.ndarray | None = None,
) -> ValueInputs:
    """The packed inputs of :func:`forward_values` (same arguments), without running a model."""
    target = _response_columns(attention_mask, response_length)
    kwargs, src, index = _packed_model_inputs(
        input_ids, attention_mask, position_ids, target, response_length=response_length, host_mask=host_mask
    )
    return ValueInputs(kwargs, src, target, index)


def values_of(model: torch.nn.Module, inputs: ValueInputs) -> torch.Tensor:
    """:func:`forward_values` (packed) on prepared inputs: values [B, R] float32, zeros off the target."""
    out = model(**_packed_call(model, inputs.model_kwargs))
    values = out.logits[0, :, 0].float()[inputs.source]
    return _scatter_response(values, inputs.target, inputs.target_index)
