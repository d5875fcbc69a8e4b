"""Forward passes shared by the roles: per-token log-probs/entropy of a causal LM and values of a critic,
over micro-batches formed by a fixed count or a token budget, with the outputs restored to batch order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from klppo.algorithms.losses import entropy_from_logits
from klppo.batch import Batch
from klppo.batching.dynamic import partition_by_token_budget, restore_order
from klppo.batching.packing import forward_log_probs, forward_values, log_probs_of, prepare_log_probs
from klppo.models.lm_head import fused_head
from klppo.parallel import ulysses
from klppo.parallel.collectives import all_reduce_max
from klppo.parallel.mesh import SequenceParallel
from klppo.roles.graphed import MicroGraphs, signature


@dataclass(frozen=True)
class MicroBatching:
    """How a batch is cut into micro-batches: ``micro_batch_size`` rows each, or (``use_dynamic_bsz``)
    groups whose real tokens (prompt + response) stay within ``max_token_len``."""

    micro_batch_size: int
    use_dynamic_bsz: bool = False
    max_token_len: int = 16384

    def partitions(self, batch: Batch) -> list[list[int]]:
        n = len(batch)
        if not self.use_dynamic_bsz:
            size = max(1, self.micro_batch_size)
            return [list(range(i, min(i + size, n))) for i in range(0, n, size)]

        if batch.host_mask is not None:
            seq_lens = [int(s) for s in batch.host_mask.sum(axis=1)]
        else:
            seq_lens = [int(s) for s in batch.attention_mask.sum(dim=1).tolist()]
        parts = partition_by_token_budget(seq_lens, self.max_token_len)
        # every data-parallel rank must run the same number of micro-batches (FSDP collectives)
        most = all_reduce_max(len(parts))
        if most != len(parts):
            parts = partition_by_token_budget(seq_lens, self.max_token_len, num_partitions_multiple=most)
        return parts


def iter_micro(batch: Batch, micro: MicroBatching) -> Iterator[tuple[list[int], Batch]]:
    for idx in micro.partitions(batch):
        yield idx, batch.select(idx)


def trim_left_padding(batch: Batch) -> Batch:
    """Drop prompt columns that are padding in every row (a micro-batch's prompts are often shorter); read
    on the host when the batch has a ``host_mask`` (no device sync)."""
    width = batch.prompts.shape[1]
    if batch.host_mask is not None:
        real = int(batch.host_mask[:, :width].sum(axis=1).max())
    else:
        real = int(batch.prompt_mask.sum(dim=1).max().item())
    cut = width - real
    if cut <= 0:
        return batch
    host = None if batch.host_mask is None else batch.host_mask[:, cut:]
    return batch.replace(
        prompts=batch.prompts[:, cut:], prompt_mask=batch.prompt_mask[:, cut:], host_mask=host
    )


def policy_forward(
    model: torch.nn.Module,
    batch: Batch,
    *,
    temperature: float,
    calculate_entropy: bool,
    use_remove_padding: bool = False,
    return_logits: bool = False,
    fused: bool = False,
    sp: SequenceParallel | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Log-prob of each response token under ``model`` with logits / ``temperature``.

    Returns ``(log_probs [B,R] fp32, entropy [B,R] or None, response logits [B,R,V] or None)``; the
    logits (for the exact ``full`` KL) come from a padded pass, everything else from
    :func:`klppo.batching.packing.forward_log_probs` (packed when ``use_remove_padding``; log-prob and
    entropy from the LM head in chunks, without [tokens, V] logits, when ``fused``), or with ``sp``
    from :func:`klppo.parallel.ulysses.forward_log_probs` (packed, this rank's share of the tokens; every
    rank of the group passes the same ``batch``).
    """
    assert sp is None or not return_logits, "full-vocabulary logits are not built with sequence parallelism"
    batch = trim_left_padding(batch)
    if not return_logits:
        log_probs, entropy = _token_forward(
            forward_log_probs,
            ulysses.forward_log_probs,
            model,
            batch,
            use_remove_padding=use_remove_padding,
            sp=sp,
            temperature=temperature,
            calculate_entropy=calculate_entropy,
            fused=fused,
        )
        return log_probs, entropy, None
    R = batch.response_length
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=R + 1,
    )
    logits = out.logits[:, :-1].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(logits) if calculate_entropy else None
    return log_probs * batch.response_mask, entropy, logits


def _token_forward(
    plain: Callable[..., Any],
    sequence_parallel: Callable[..., Any],
    model: torch.nn.Module,
    batch: Batch,
    *,
    use_remove_padding: bool,
    sp: SequenceParallel | None,
    **kwargs: Any,
) -> Any:
    """One forward over ``batch``'s rows: ``plain`` (packed when ``use_remove_padding``, else padded), or
    with ``sp`` its ``sequence_parallel`` twin (packed, this rank's share of the group's tokens)."""
    args = (model, batch.input_ids, batch.attention_mask, batch.position_ids)
    if sp is not None:
        return sequence_parallel(*args, response_length=batch.response_length, sp=sp, **kwargs)
    return plain(
        *args,
        response_length=batch.response_length,
        use_remove_padding=use_remove_padding,
        host_mask=batch.host_mask,
        **kwargs,
    )


def check_fused(model: torch.nn.Module, key: str) -> None:
    """One-line error naming ``key`` when the model's LM head cannot give fused token statistics."""
    if fused_head(model) is None:
        raise ValueError(
            f"{key}=True needs a bias-free linear LM head returned as is (no logit soft-capping); "
            f"{type(model).__name__} has none: set it to False"
        )


def value_forward(
    model: torch.nn.Module,
    batch: Batch,
    *,
    use_remove_padding: bool = False,
    sp: SequenceParallel | None = None,
) -> torch.Tensor:
    """Values [B,R] fp32 of a token-classification critic: the value at the position before each response
    token (the state in which that token is chosen), as verl's critic; zero on masked positions. With
    ``sp``: sequence-parallel over the group (same ``batch`` on its ranks)."""
    return _token_forward(
        forward_values,
        ulysses.forward_values,
        model,
        trim_left_padding(batch),
        use_remove_padding=use_remove_padding,
        sp=sp,
    )


@dataclass
class ForwardPlan:
    """One batch cut into micro-batches and packed once, for the no-grad log-prob passes: the
    old-log-prob and the reference passes read the same plan (same micro-batches, same token order) when
    their micro-batching and padding removal agree, instead of each partitioning and packing again."""

    micro: MicroBatching
    use_remove_padding: bool
    partitions: list[list[int]]
    inputs: list  # [LogProbInputs] per micro-batch

    @classmethod
    def build(cls, batch: Batch, micro: MicroBatching, *, use_remove_padding: bool) -> ForwardPlan:
        partitions, inputs = [], []
        for idx, mb in iter_micro(batch.with_host_mask(), micro):
            mb = trim_left_padding(mb)
            partitions.append(idx)
            inputs.append(
                prepare_log_probs(
                    mb.input_ids,
                    mb.attention_mask,
                    mb.position_ids,
                    response_length=mb.response_length,
                    use_remove_padding=use_remove_padding,
                    host_mask=mb.host_mask,
                )
            )
        return cls(micro, use_remove_padding, partitions, inputs)

    def serves(self, micro: MicroBatching, use_remove_padding: bool) -> bool:
        return self.micro == micro and self.use_remove_padding == use_remove_padding

    @classmethod
    def reused_or_built(
        cls, plan: ForwardPlan | None, batch: Batch, micro: MicroBatching, *, use_remove_padding: bool
    ) -> ForwardPlan:
        """``plan`` when it has this micro-batching and padding removal (another pass's, over the same
        ``batch``), else a plan built for them."""
        if plan is not None and plan.serves(micro, use_remove_padding):
            return plan
        return cls.build(batch, micro, use_remove_padding=use_remove_padding)


def log_prob_pass(
    model: torch.nn.Module,
    plan: ForwardPlan,
    *,
    temperature: float,
    fused: bool,
    graphs: MicroGraphs | None = None,
) -> torch.Tensor:
    """Log-probs [B, R] (batch order) of the plan's micro-batches under ``model``, without gradients; with
    ``graphs`` (packed plans only) each micro-batch through them (:func:`graphed_forward`)."""

    def log_probs(x: Any) -> torch.Tensor:
        return log_probs_of(model, x, temperature=temperature, fused=fused)[0]

    with torch.no_grad():
        if graphs is None:
            chunks = [log_probs(x) for x in plan.inputs]
        else:
            chunks = [
                graphed_forward(graphs, x, log_probs, extra=("log_prob", temperature, fused))
                for x in plan.inputs
            ]
    return restore_order(chunks, plan.partitions)


def graphed_forward(
    graphs: MicroGraphs, inputs: Any, fn: Callable[[Any], torch.Tensor], *, extra: Any
) -> torch.Tensor:
    """``fn(inputs)`` — one no-grad forward of a prepared micro-batch (``LogProbInputs`` or ``ValueInputs``,
    :func:`split_inputs`) — through ``graphs`` (:mod:`klppo.roles.graphed`: eager the first time its signature
    is met, captured the second, replayed after); ``extra``: the Python values ``fn`` reads (its signature).
    The result is a copy: a replay writes the graph's output tensor again."""
    tensors, key, rebuild = split_inputs(inputs)
    out = graphs.run(signature(tensors, extra=(key, extra)), tensors, lambda ts: [fn(rebuild(ts))])
    return out[0].clone()


def no_grad_pass(
    batch: Batch,
    micro: MicroBatching,
    fn: Callable[[Batch], torch.Tensor],
    sp: SequenceParallel | None = None,
) -> torch.Tensor:
    """Run ``fn`` over micro-batches without gradients; outputs [B, ...] in batch order.

    With ``sp`` the ranks of the group hold different rows (each its share of the rollout): the group's
    rows are gathered, ``fn`` runs sequence-parallel on all of them, and each rank keeps its own."""
    if sp is not None:
        n = len(batch)
        return no_grad_pass(ulysses.gather_group_rows(batch, sp), micro, fn)[sp.rank * n : (sp.rank + 1) * n]
    partitions, chunks = [], []
    with torch.no_grad():
        for idx, mb in iter_micro(batch.with_host_mask(), micro):
            partitions.append(idx)
            chunks.append(fn(mb))
    return restore_order(chunks, partitions)


def split_inputs(inputs: Any) -> tuple[list[torch.Tensor], tuple, Callable[[Sequence[torch.Tensor]], Any]]:
    """A prepared micro-batch (:class:`klppo.batching.packing.LogProbInputs` or ``ValueInputs``) as its device
    tensors (model arguments first, then the other fields, in a fixed order), a hashable key of the rest (the
    model arguments that are not tensors — the packed maximum lengths —, the fields that are not tensors) and
    how to rebuild it around other tensors of the same shapes (a CUDA graph's static copies,
    :mod:`klppo.roles.graphed`)."""
    cls, kwargs = type(inputs), inputs.model_kwargs
    kw_names = tuple(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    kw_rest = tuple((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
    names = [f.name for f in dataclasses.fields(inputs) if f.name != "model_kwargs"]
    tensor_fields = tuple(f for f in names if isinstance(getattr(inputs, f), torch.Tensor))
    rest = tuple((f, getattr(inputs, f)) for f in names if f not in tensor_fields)
    tensors = [kwargs[k] for k in kw_names] + [getattr(inputs, f) for f in tensor_fields]
    n = len(kw_names)

    def rebuild(ts: Sequence[torch.Tensor]) -> Any:
        model_kwargs = dict(kw_rest) | dict(zip(kw_names, ts[:n], strict=True))
        return cls(model_kwargs=model_kwargs, **dict(rest), **dict(zip(tensor_fields, ts[n:], strict=True)))

    return tensors, (cls.__name__, kw_names, kw_rest, tensor_fields, rest), rebuild
