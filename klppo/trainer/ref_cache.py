"""Reference log-probs of logged samples, kept across passes over the logs.

The reference model does not change during a run, so on a run that trains on logged samples only
(``data.logged_files`` without ``data.train_files``) a sample's reference log-probs are the same on every
pass over the logs. After each step's gather every rank keeps those of every sample of the global batch
(so that all ranks hold the same entries), keyed by the sample's prompt and response tokens; a step whose
samples all have entries on every rank takes them instead of running the reference pass. One all-reduce
per step decides, so that either every rank runs its (sharded, collective) reference pass or none does.
Entries take host memory, up to ``MAX_BYTES`` per rank; past it, samples not yet kept are not kept (said
once in the log) and the steps that hold them run the pass. Entries are not checkpointed: a resumed run
runs the pass on its first steps again.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import torch

from klppo.batch import Batch
from klppo.parallel.collectives import all_reduce_max, rank

log = logging.getLogger(__name__)

MAX_BYTES = 4 << 30
"""Host memory of the kept log-probs per rank (float32: 4 GiB hold ~1M samples of 1,000 tokens)."""


class RefLogProbCache:
    """The kept reference log-probs (module docstring): :meth:`lookup` before the pass, :meth:`keep` after
    the gather."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = MAX_BYTES if max_bytes is None else max_bytes
        self.bytes = 0
        self._entries: dict[bytes, torch.Tensor] = {}
        self._full_said = False
        self._step_found = False  # the last lookup found every rank's samples: the step brings none new

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, samples: Batch) -> torch.Tensor | None:
        """[B, R] float32 reference log-probs of ``samples`` (0 past each response) on their device when
        every rank has kept all of its samples, else None: then every rank runs the reference pass."""
        found = [self._entries.get(k) for k in _keys(samples)]
        self._step_found = not all_reduce_max(int(any(f is None for f in found)))
        if not self._step_found:
            return None
        assert samples.response_mask is not None
        out = torch.zeros(samples.response_mask.shape, dtype=torch.float32)
        for i, values in enumerate(found):
            out[i, : len(values)] = values
        return out.to(samples.response_mask.device)

    def keep(self, batch: Batch) -> None:
        """Keep the reference log-probs of ``batch`` (the step's global batch, the same on every rank) up to
        each sample's last response token; a sample with a non-finite one is not kept. After a lookup that
        found every rank's samples there is nothing new to keep (the global batch is their union)."""
        if batch.ref_log_probs is None or self._step_found:
            return
        lengths = batch.response_tokens_mask.sum(dim=1).long().tolist()
        values = batch.ref_log_probs.detach().to("cpu", torch.float32)
        for key, row, n in zip(_keys(batch), values, lengths, strict=True):
            if key in self._entries or not bool(torch.isfinite(row[:n]).all()):
                continue  # a non-finite value is not kept: the step skips it, a later pass recomputes
            if self.bytes + 4 * n > self.max_bytes:
                self._say_full()
                return
            self._entries[key] = row[:n].clone()
            self.bytes += 4 * n

    def _say_full(self) -> None:
        if not self._full_said and rank() == 0:
            log.info(
                "reference log-probs of %d logged samples kept (%.1f GiB, the most a rank keeps); steps "
                "with samples beyond them run the reference pass",
                len(self._entries),
                self.bytes / 2**30,
            )
        self._full_said = True


def _keys(batch: Batch) -> list[bytes]:
    """One key per sample: a hash of its prompt tokens and its response tokens (padding left out)."""
    assert batch.responses is not None
    prompts, prompt_mask = batch.prompts.cpu().numpy(), batch.prompt_mask.cpu().numpy().astype(bool)
    responses = batch.responses.cpu().numpy()
    response_mask = batch.response_tokens_mask.cpu().numpy().astype(bool)
    keys = []
    for p, pm, r, rm in zip(prompts, prompt_mask, responses, response_mask, strict=True):
        h = hashlib.blake2b(digest_size=16)
        h.update(np.ascontiguousarray(p[pm], dtype=np.int64).tobytes())
        h.update(b"|")
        h.update(np.ascontiguousarray(r[rm], dtype=np.int64).tobytes())
        keys.append(h.digest())
    return keys
