"""The reward role: rule scorers / a user's function by ``data_source``, or a sequence-classification
reward model; scores land on each response's last token (``token_level_scores``)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from klppo.batch import Batch
from klppo.parallel.collectives import rank
from klppo.rewards import RewardManager, place_scores
from klppo.roles.decoding import decode_batch
from klppo.roles.reward_limit import RewardTimeoutError, deadline, sample_where, timeout_message
from klppo.roles.reward_worker import ScoringWorker, WorkerStartError


class Scores(NamedTuple):
    """What :meth:`Reward.score` gives for a batch of ``B`` samples."""

    token_level: torch.Tensor
    """[B, R] float32: each sequence's score on its last response token, 0 elsewhere."""
    sequence: torch.Tensor
    """[B] float32: one score per sample."""
    texts: list[str]
    """The decoded responses that were scored."""


def response_rows(batch: Batch) -> tuple[list[list[int]], list[int]]:
    """Each response's token ids cut at its mask, and their lengths (one host read of the batch)."""
    lengths = batch.response_tokens_mask.sum(dim=1).long().tolist()
    return [ids[:n] for ids, n in zip(batch.responses.tolist(), lengths)], lengths


class PendingScores:
    """Scores being computed in the background (:meth:`Reward.submit`); :meth:`result` waits for them, or
    computes them in the step if the worker process died meanwhile."""

    def __init__(self, futures: list[Future], reward: Reward, batch: Batch) -> None:
        self._futures, self._reward, self._batch = futures, reward, batch
        self._started = time.monotonic()

    def result(self) -> Scores:
        """The scores, within ``reward_model.timeout_s`` of the submission (else the processes are stopped
        and :class:`RewardTimeoutError` names the row being scored)."""
        values: list[float] = []
        texts: list[str] = []
        limit = self._reward.timeout_s
        try:
            for slot, future in enumerate(self._futures):  # the slices in row order
                left = None if limit <= 0 else max(0.0, self._started + limit - time.monotonic())
                try:
                    part_values, part_texts = future.result(timeout=left)
                except TimeoutError:
                    raise self._timed_out(slot) from None
                values += part_values
                texts += part_texts
        except (BrokenProcessPool, WorkerStartError) as exc:
            if self._reward.worker is not None:
                self._reward.worker.mark_broken(exc)
            return self._reward.score(self._batch)
        return _scores(self._batch, torch.tensor(values, dtype=torch.float32), texts)

    def _timed_out(self, slot: int) -> RewardTimeoutError:
        reward, batch = self._reward, self._batch
        row = reward.worker.row_of(slot) if reward.worker is not None else -1
        reward.close()  # a hung function is not waited for
        where = sample_where(row, batch.data_source, batch.uid)
        what = reward.manager.describe
        return RewardTimeoutError(
            timeout_message(rank=rank(), timeout_s=reward.timeout_s, what=what, where=where)
        )


def _scores(batch: Batch, seq_scores: torch.Tensor, texts: list[str]) -> Scores:
    """Per-sequence scores on the batch's device, placed on each response's last token."""
    seq_scores = seq_scores.to(batch.response_mask.device)
    return Scores(place_scores(seq_scores, batch.response_mask), seq_scores, texts)


@dataclass(frozen=True)
class RewardModelPasses:
    """A reward model and how it scores: its tokenizer (None: the policy's), the truncation of its inputs,
    and its micro-batches — ``max_token_len`` tokens each (``use_dynamic_bsz``), else ``micro_batch_size``
    samples (None: 16)."""

    model: torch.nn.Module | None = None
    tokenizer: Any = None
    max_length: int | None = None
    micro_batch_size: int | None = None
    max_token_len: int | None = None


class Reward:
    """``score(batch) -> Scores`` (token-level scores, per-sequence scores, response texts); with
    ``background`` and no reward model, :meth:`submit` scores in a worker process instead
    (:mod:`klppo.roles.reward_worker`)."""

    def __init__(
        self,
        tokenizer,
        *,
        custom_fn_path: str | None = None,
        custom_fn_name: str = "compute_score",
        reward_kwargs: dict | None = None,
        reward_manager: str = "naive",
        model: RewardModelPasses = RewardModelPasses(),
        background: bool = False,
        num_workers: int = 1,
        timeout_s: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s  # a batch's scoring by the rule / user function (klppo.roles.reward_limit)
        manager_kwargs = dict(
            custom_fn_path=custom_fn_path,
            custom_fn_name=custom_fn_name,
            reward_kwargs=dict(reward_kwargs or {}),
            reward_manager=reward_manager,
        )
        self.manager = RewardManager(**manager_kwargs)  # here first: a bad function fails before the worker
        self.reward_model = model.model
        self.reward_tokenizer = model.tokenizer or tokenizer
        self.max_length = model.max_length
        # the reward model's micro-batches: a token budget (use_dynamic_bsz) or a number of samples
        self.micro_batch_size, self.max_token_len = model.micro_batch_size or 16, model.max_token_len
        # the reward model scores in the step (on the device); the config checks say so when both are set
        background = background and model.model is None
        self.worker = ScoringWorker(tokenizer, manager_kwargs, num_workers) if background else None

    def submit(self, batch: Batch, seed: int | None = None) -> PendingScores | None:
        """Start scoring ``batch`` in the worker process (the generators there seeded from ``seed``); None
        when this reward scores in the step."""
        if self.worker is None or not self.worker.alive:
            return None
        rows, lengths = response_rows(batch)
        futures = self.worker.submit(
            rows, batch.data_source, batch.ground_truth, batch.extra_info, lengths, seed=seed
        )
        return None if futures is None else PendingScores(futures, self, batch)

    def close(self) -> None:
        """Stop the worker process (if any)."""
        if self.worker is not None:
            self.worker.close()
            self.worker = None

    def decode_responses(self, batch: Batch) -> list[str]:
        return decode_batch(self.tokenizer, response_rows(batch)[0])

    def score(self, batch: Batch) -> Scores:
        rows, lengths = response_rows(batch)
        texts = decode_batch(self.tokenizer, rows)
        if self.reward_model is not None:
            seq_scores = self._model_scores(batch, texts)
        else:
            manager = self.manager

            def message() -> str:
                where = sample_where(manager.current_row, batch.data_source, batch.uid)
                return timeout_message(
                    rank=rank(), timeout_s=self.timeout_s, what=manager.describe, where=where
                )

            with deadline(self.timeout_s, message):
                values = manager.score(
                    texts, batch.data_source, batch.ground_truth, batch.extra_info, lengths
                )
            seq_scores = torch.tensor(values, dtype=torch.float32)
        return _scores(batch, seq_scores, texts)

    def _micro_batches(self, lengths: list[int]) -> list[tuple[int, int]]:
        """(start, end) of each micro-batch of samples of token ``lengths``: ``micro_batch_size`` samples, or
        with a token budget as many consecutive samples as fit padded to the longest (one at least)."""
        if self.max_token_len is None:
            step = self.micro_batch_size
            return [(i, min(i + step, len(lengths))) for i in range(0, len(lengths), step)]
        bounds, start, longest = [], 0, 0
        for i, length in enumerate(lengths):
            longest = max(longest, length)
            if i > start and longest * (i - start + 1) > self.max_token_len:
                bounds.append((start, i))
                start, longest = i, length
        return [*bounds, (start, len(lengths))] if lengths else []

    @torch.no_grad()
    def _model_scores(self, batch: Batch, texts: list[str]) -> torch.Tensor:
        """Re-tokenize (chat prompt + response) with the reward model's own template, once, and score it in
        right-padded micro-batches (the model reads its score at the last non-pad token)."""
        tok = self.reward_tokenizer
        device = next(self.reward_model.parameters()).device
        chats = []
        for messages, response in zip(batch.raw_prompt, texts):
            chat = list(messages) + [{"role": "assistant", "content": response}]
            if getattr(tok, "chat_template", None):
                chats.append(tok.apply_chat_template(chat, tokenize=False))
            else:
                chats.append("\n".join(m["content"] for m in chat))
        enc = tok(chats, truncation=self.max_length is not None, max_length=self.max_length)
        scores = []
        for start, end in self._micro_batches([len(ids) for ids in enc["input_ids"]]):
            part = {key: values[start:end] for key, values in enc.items()}
            padded = tok.pad(part, padding=True, padding_side="right", return_tensors="pt")
            out = self.reward_model(**{k: v.to(device) for k, v in padded.items()})
            scores.append(out.logits[:, 0].float().cpu())
        return torch.cat(scores)
