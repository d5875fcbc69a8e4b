"""Independent float64 references for tests/algorithms: plain Python loops over rows and tokens.

Written from the formulas in docs/algorithms.md, sharing no code with klppo.algorithms.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch


def rows(x: torch.Tensor) -> list[list[float]]:
    return x.detach().to(torch.float64).tolist()


def mask_rows(m: torch.Tensor) -> list[list[bool]]:
    return [[bool(v) for v in row] for row in m.tolist()]


def valid_values(x: torch.Tensor, m: torch.Tensor) -> list[float]:
    return [v for xr, mr in zip(rows(x), mask_rows(m)) for v, k in zip(xr, mr) if k]


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def var_unbiased(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mu = mean(xs)
    return sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)


def whiten(x: torch.Tensor, m: torch.Tensor) -> list[list[float]]:
    vals = valid_values(x, m)
    mu, var = mean(vals), var_unbiased(vals)
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [[(v - mu) * scale if k else 0.0 for v, k in zip(xr, mr)] for xr, mr in zip(rows(x), mask_rows(m))]


def kl_estimate(lp: float, rp: float, kind: str) -> float:
    r = lp - rp
    if kind in ("kl", "k1"):
        return r
    if kind == "abs":
        return abs(r)
    if kind in ("mse", "k2"):
        return 0.5 * r * r
    if kind in ("low_var_kl", "k3"):
        u = min(max(rp - lp, -20.0), 20.0)
        return min(max(math.exp(u) - u - 1.0, -10.0), 10.0)
    raise KeyError(kind)


def gae(r: torch.Tensor, v: torch.Tensor, m: torch.Tensor, gamma: float, lam: float):
    """Unwhitened advantages and returns; masked tokens are removed from the trajectory."""
    adv_rows, ret_rows = [], []
    for rr, vr, mr in zip(rows(r), rows(v), mask_rows(m)):
        idx = [t for t, k in enumerate(mr) if k]
        adv = [0.0] * len(rr)
        ret = [0.0] * len(rr)
        next_v, next_a = 0.0, 0.0
        for t in reversed(idx):
            delta = rr[t] + gamma * next_v - vr[t]
            next_a = delta + gamma * lam * next_a
            next_v = vr[t]
            adv[t] = next_a
            ret[t] = next_a + vr[t]
        adv_rows.append(adv)
        ret_rows.append(ret)
    return adv_rows, ret_rows


def group_outcome(r: torch.Tensor, m: torch.Tensor, ids, mode: str, eps: float = 1e-6):
    scores = [sum(row) for row in rows(r)]
    groups = defaultdict(list)
    for i, g in enumerate(ids):
        groups[g].append(i)
    out = []
    for i, g in enumerate(ids):
        members = groups[g]
        s = scores[i]
        n = len(members)
        if mode == "grpo" or mode == "grpo_nostd":
            if n == 1:
                mu, sd = 0.0, 1.0
            else:
                vals = [scores[j] for j in members]
                mu, sd = mean(vals), math.sqrt(var_unbiased(vals))
            a = (s - mu) / (sd + eps) if mode == "grpo" else s - mu
        elif mode == "rloo":
            others = [scores[j] for j in members if j != i]
            a = s - mean(others) if others else s
        else:
            raise KeyError(mode)
        out.append(a)
    return [[a if k else 0.0 for k in mr] for a, mr in zip(out, mask_rows(m))]


def _groups(ids) -> dict:
    groups = defaultdict(list)
    for i, g in enumerate(ids):
        groups[g].append(i)
    return groups


def _broadcast(per_row: list[float], m: torch.Tensor) -> list[list[float]]:
    return [[a if k else 0.0 for k in mr] for a, mr in zip(per_row, mask_rows(m))]


def rf_pp_baseline(r: torch.Tensor, m: torch.Tensor, ids) -> list[list[float]]:
    """REINFORCE++-baseline: s_i − group mean (0 for a singleton) on every token, whitened over the batch."""
    scores = [sum(row) for row in rows(r)]
    groups = _groups(ids)
    centred = []
    for i, g in enumerate(ids):
        members = groups[g]
        mu = mean([scores[j] for j in members]) if len(members) > 1 else 0.0
        centred.append(scores[i] - mu)
    return whiten(torch.tensor(_broadcast(centred, m), dtype=torch.float64), m)


def opo(r: torch.Tensor, m: torch.Tensor, ids) -> list[list[float]]:
    """OPO: s_i − Σ_j l_j s_j / Σ_j l_j over the group (l = response length); singleton baseline 0."""
    scores = [sum(row) for row in rows(r)]
    lengths = [sum(1 for k in mr if k) for mr in mask_rows(m)]
    groups = _groups(ids)
    out = []
    for i, g in enumerate(ids):
        members = groups[g]
        total = sum(lengths[j] for j in members)
        b = 0.0
        if len(members) > 1 and total > 0:
            b = sum(lengths[j] * scores[j] for j in members) / total
        out.append(scores[i] - b)
    return _broadcast(out, m)


def grpo_passk(r: torch.Tensor, m: torch.Tensor, ids, norm_by_std: bool, eps: float = 1e-6):
    """Pass@k: the unique best row of a group gets (best − second best) [/ (std + eps)]; ties give 0."""
    scores = [sum(row) for row in rows(r)]
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        vals = sorted((scores[j] for j in members), reverse=True)
        best_rows = [j for j in members if scores[j] == vals[0]]
        if len(best_rows) != 1:
            continue
        a = vals[0] - vals[1]
        if norm_by_std:
            a /= math.sqrt(var_unbiased(vals)) + eps
        out[best_rows[0]] = a
    return _broadcast(out, m)


def gpg(r: torch.Tensor, m: torch.Tensor, ids) -> list[list[float]]:
    """GPG: (B / #non-zero scores) · (s_i − group mean), singleton mean 0."""
    scores = [sum(row) for row in rows(r)]
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    groups = _groups(ids)
    out = []
    for i, g in enumerate(ids):
        members = groups[g]
        mu = mean([scores[j] for j in members]) if len(members) > 1 else 0.0
        out.append(alpha * (scores[i] - mu))
    return _broadcast(out, m)


def discounted_returns(r: torch.Tensor, m: torch.Tensor, gamma: float):
    """REINFORCE++ returns: G_t over the row, reset after every masked position."""
    out = []
    for rr, mr in zip(rows(r), mask_rows(m)):
        g_next = 0.0
        ret = [0.0] * len(rr)
        for t in reversed(range(len(rr))):
            g = rr[t] + gamma * g_next
            ret[t] = g if mr[t] else 0.0
            g_next = g if mr[t] else 0.0
        out.append(ret)
    return out


def agg(loss: torch.Tensor, m: torch.Tensor, mode: str) -> float:
    lr, mr = rows(loss), mask_rows(m)
    if mode == "token-mean":
        return mean(valid_values(loss, m))
    sums = [sum(v for v, k in zip(a, b) if k) for a, b in zip(lr, mr)]
    if mode == "seq-mean-token-sum":
        return sum(sums) / len(sums)
    if mode == "seq-mean-token-mean":
        per = [s / sum(b) for s, b in zip(sums, mr) if sum(b) > 0]
        return mean(per)
    if mode == "seq-mean-token-sum-norm":
        return sum(sums) / loss.shape[-1]
    raise KeyError(mode)


def softmax_row(z: list[float]) -> list[float]:
    mx = max(z)
    e = [math.exp(v - mx) for v in z]
    s = sum(e)
    return [v / s for v in e]


def make_mask(batch: int, length: int, gen: torch.Generator, *, contiguous: bool = True) -> torch.Tensor:
    """Right-padded 0/1 float mask with random lengths; row 0 is empty when batch > 1.

    ``contiguous=False`` punches random holes (multi-turn style observation tokens).
    """
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    if batch > 1:
        lengths[0] = 0
    m = (torch.arange(length)[None, :] < lengths[:, None]).to(torch.float64)
    if not contiguous:
        m = m * (torch.rand(batch, length, generator=gen, dtype=torch.float64) > 0.3)
    return m
