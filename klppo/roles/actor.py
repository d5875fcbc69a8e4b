"""The actor: the policy model, its optimizer, log-prob recomputation and the PPO policy update
(the ``policy_loss.loss_mode`` loss from ``klppo.algorithms.losses.POLICY_LOSSES``, optional KL loss
toward the reference and entropy bonus). The update loop itself is
:class:`klppo.roles.trained.TrainedRole`'s.

On-policy updates (one epoch over one mini-batch) need no separate old-log-prob pass: every forward of the
update runs on the weights that generated nothing new since the rollout, so π_old = π_θ and the ratio is 1
by construction. With ``skip_old_log_prob_on_policy`` the trainer then leaves ``old_log_probs`` unset and
:meth:`Actor.update_policy` uses the update's own log-probs, detached, as π_old; the statistics the skipped
pass gave (``rollout/log_prob_diff``, ``actor/ref_kl_k1``) come from those same log-probs.

In bypass mode (``algorithm.rollout_correction.bypass_mode``) π_old is the behaviour policy: the trainer
leaves ``old_log_probs`` unset too, the loss takes ``rollout_log_probs`` (the engine's, or the log's) as
π_old, and the same statistics come from the update's forward — the KL to the reference of the policy being
trained, not of the one that sampled (which, for logged responses, may be another model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from klppo.algorithms import kl as kl_mod
from klppo.algorithms import losses
from klppo.algorithms import rollout_correction as rc
from klppo.batch import Batch, rollout_softmax_log_probs
from klppo.batching.packing import log_probs_of, prepare_log_probs
from klppo.parallel.mesh import SequenceParallel
from klppo.parallel.plain import MasterWeights
from klppo.roles.forward import (
    ForwardPlan,
    MicroBatching,
    check_fused,
    log_prob_pass,
    no_grad_pass,
    policy_forward,
    split_inputs,
    trim_left_padding,
)
from klppo.roles.graphed import MicroParts, cleared_on_retry
from klppo.roles.optim import OptimSettings
from klppo.roles.trained import LossTerms, TrainedRole, UpdateSettings


@dataclass(frozen=True)
class ActorSettings:
    """PPO update settings of the actor (verl's ``actor_rollout_ref.actor.*``), sizes per rank in samples."""

    ppo_epochs: int = 1
    mini_batch_size: int = 8
    update_micro: MicroBatching = MicroBatching(micro_batch_size=4)
    log_prob_micro: MicroBatching = MicroBatching(micro_batch_size=8)
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # constant divisor of seq-mean-token-sum-norm (all loss terms)
    loss_mode: str = "vanilla"  # policy_loss.loss_mode: a key of klppo.algorithms.losses.POLICY_LOSSES
    policy_loss_options: object = None  # the mode's POLICY_LOSS_OPTIONS instance (policy_loss.* keys), if any
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0
    shuffle: bool = False
    use_remove_padding: bool = False
    seed: int = 1
    skip_old_log_prob_on_policy: bool = False  # π_old = the update's detached log-probs when on-policy
    use_fused_kernels: bool = False  # log-probs/entropy from the LM head in chunks (models/lm_head.py)
    sp: SequenceParallel | None = None  # Ulysses group (needs use_remove_padding); None: no sequence split
    grad_sync_per_mini_batch: bool = False  # one reduce-scatter per mini-batch (roles/trained.py)
    cuda_graph_update: bool = False  # micro-batches replayed as CUDA graphs (roles/graphed.py; plain path)
    rollout_correction: rc.CorrectionSettings | None = None  # bypass mode: corrected here, per micro-batch


class Actor(TrainedRole):
    """Policy role: ``compute_log_prob(batch)`` and ``update_policy(batch) -> metrics``."""

    name = "actor"
    graph_key = "actor_rollout_ref.actor.fsdp_config"

    def __init__(
        self,
        model: torch.nn.Module,
        settings: ActorSettings,
        optim: OptimSettings,
        *,
        masters: MasterWeights | None = None,
    ) -> None:
        super().__init__(
            model,
            UpdateSettings.of(settings),
            optim,
            masters=masters,
        )
        self.settings = settings
        # the policy loss and the aggregation it applies, chosen once (not looked up per micro-batch)
        self._pg_loss_fn = losses.get_policy_loss(settings.loss_mode)
        self._pg_agg_mode = losses.policy_loss_agg_mode(settings.loss_mode, settings.loss_agg_mode)
        if settings.use_fused_kernels:
            check_fused(model, "actor_rollout_ref.actor.use_fused_kernels")
        if self.graphs is not None and not self.graph_capable():
            if settings.loss_mode in HOST_SYNC_LOSS_MODES:  # they read the token count on the host
                raise ValueError(
                    "actor_rollout_ref.actor.fsdp_config.cuda_graph_update=true cannot capture "
                    f"policy_loss.loss_mode={settings.loss_mode} (it reads the micro-batch's token count on "
                    "the host): set it to false"
                )
            raise ValueError(
                "actor_rollout_ref.actor.fsdp_config.cuda_graph_update=true needs packed rows "
                "(actor_rollout_ref.model.use_remove_padding=true), no sequence parallelism and not "
                "kl_loss_type=full: set it to false"
            )

    def graph_capable(self) -> bool:
        """Packed rows, no sequence parallelism, not the ``full`` KL (its reference logits come from a
        callback outside the step), a loss mode that stays on the device: what :meth:`graph_parts` serves."""
        s = self.settings
        full = s.use_kl_loss and s.kl_loss_type == "full"
        return s.use_remove_padding and s.sp is None and not full and s.loss_mode not in HOST_SYNC_LOSS_MODES

    def log_prob_plan(self, batch: Batch) -> ForwardPlan:
        """The micro-batches of :meth:`compute_log_prob`, packed (shareable with the reference)."""
        s = self.settings
        micro = self.oom.current("log_prob", s.log_prob_micro)  # halved after an out-of-memory retry
        return ForwardPlan.build(batch, micro, use_remove_padding=s.use_remove_padding)

    def compute_log_prob(self, batch: Batch, *, plan: ForwardPlan | None = None) -> torch.Tensor:
        """Log-probs [B,R] of the batch's responses under the current policy (no gradient), over ``plan``
        when it has this role's micro-batching."""
        self.model.eval()
        s = self.settings

        def attempt(micro: MicroBatching) -> torch.Tensor:
            if s.sp is not None:  # Ulysses: the group's rows, split along the tokens (no shared plan)
                return no_grad_pass(batch, micro, self._sp_log_probs, sp=s.sp)
            use = ForwardPlan.reused_or_built(plan, batch, micro, use_remove_padding=s.use_remove_padding)
            return log_prob_pass(
                self.model,
                use,
                temperature=s.temperature,
                fused=s.use_fused_kernels,
                graphs=self.forward_graphs,
            )

        # out of memory: the role's graphs go with the larger micro-batches (one pool with the update's)
        attempt = cleared_on_retry(attempt, self.graphs, self.forward_graphs)
        return self.oom.run("log_prob", s.log_prob_micro, attempt, self.model)

    def _sp_log_probs(self, mb: Batch) -> torch.Tensor:
        s = self.settings
        return policy_forward(
            self.model,
            mb,
            temperature=s.temperature,
            calculate_entropy=False,
            fused=s.use_fused_kernels,
            sp=s.sp,
        )[0]

    @property
    def bypass_mode(self) -> bool:
        """Bypass mode: π_old is the behaviour policy's ``rollout_log_probs``."""
        corr = self.settings.rollout_correction
        return corr is not None and corr.bypass_mode

    def skips_old_log_prob(self, num_rows: int) -> bool:
        """True when an update over ``num_rows`` samples per rank is on-policy (one epoch, one mini-batch)
        and ``skip_old_log_prob_on_policy`` is set: the trainer need not compute ``old_log_probs``."""
        s = self.settings
        return s.skip_old_log_prob_on_policy and s.ppo_epochs == 1 and num_rows <= s.mini_batch_size

    def update_policy(
        self,
        batch: Batch,
        *,
        kl_loss_coef: float | None = None,
        ref_logits_fn: Callable[[Batch], torch.Tensor] | None = None,
        num_mini_batches: int | None = None,
    ) -> dict[str, float]:
        """``ppo_epochs`` passes over mini-batches; one optimizer step per mini-batch (``num_mini_batches``:
        that many equal parts of ``batch`` instead of ``mini_batch_size`` rows each, :meth:`run_updates`).

        Needs ``old_log_probs``, ``advantages``, ``response_mask`` (and ``ref_log_probs`` for the KL loss;
        ``ref_logits_fn`` giving reference logits [b,R,V] when ``kl_loss_type='full'``). ``kl_loss_coef``
        is this step's β of the KL loss (from the trainer's controller); ``None`` = ``settings.kl_loss_coef``.
        Without ``old_log_probs`` the update must be on-policy (:meth:`skips_old_log_prob`) or in bypass mode.
        """
        on_policy = self.skips_old_log_prob(len(batch)) and (num_mini_batches or 1) == 1
        if batch.old_log_probs is None and not (on_policy or self.bypass_mode):
            raise ValueError(
                "actor update: old_log_probs missing, and the update is not on-policy "
                f"(ppo_epochs={self.settings.ppo_epochs}, {len(batch)} samples, mini-batch "
                f"{self.settings.mini_batch_size}, "
                f"{num_mini_batches or 'by size'} mini-batches)"
            )
        beta = self.settings.kl_loss_coef if kl_loss_coef is None else float(kl_loss_coef)
        return self.run_updates(
            batch,
            lambda mb: self._micro_loss(mb, ref_logits_fn, beta),
            num_mini_batches=num_mini_batches,
            graph_parts=None if self.graphs is None else lambda mb: self.graph_parts(mb, beta),
        )

    def _micro_loss(
        self, mb: Batch, ref_logits_fn, kl_loss_coef: float
    ) -> tuple[LossTerms, dict[str, float | torch.Tensor]]:
        """The policy term (weighted by the aggregation its loss mode applies), the entropy bonus and the KL
        loss (weighted by ``loss_agg_mode``), and the micro-batch's statistics."""
        s = self.settings
        need_logits = s.use_kl_loss and s.kl_loss_type == "full"
        log_prob, entropy, logits = policy_forward(
            self.model,
            mb,
            temperature=s.temperature,
            calculate_entropy=True,  # the actor/entropy metric always; the bonus only with entropy_coeff
            use_remove_padding=s.use_remove_padding,
            return_logits=need_logits,
            fused=s.use_fused_kernels,
            sp=s.sp,
        )
        ref_logits = None
        if need_logits:
            with torch.no_grad():
                ref_logits = ref_logits_fn(mb)
        return self._loss_terms(mb, log_prob, entropy, kl_loss_coef, logits=logits, ref_logits=ref_logits)

    def _policy_loss(
        self, mb: Batch | SimpleNamespace, old_log_prob: torch.Tensor, log_prob: torch.Tensor, stats: dict
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The ``loss_mode`` policy loss, weighted by the batch's ``rollout_is_weights`` when it has them
        (decoupled rollout correction). In bypass mode (π_old = π_rollout) the correction of this
        micro-batch's current policy against the rollout's is computed here, its ``rollout_corr/*`` added to
        ``stats``, and ``loss_type=reinforce`` replaces the loss by :func:`rc.reinforce_loss`; tokens that
        ``rollout_rs`` rejects weigh 0 in the policy loss and stay in its divisor (verl's token counts of the
        mini-batch), the entropy and KL terms keep them (as verl's bypass loss)."""
        s = self.settings
        corr = s.rollout_correction
        weights = mb.rollout_is_weights
        if corr is not None and corr.bypass_mode:
            correction = corr.apply(log_prob.detach(), mb.rollout_log_probs, mb.response_mask)
            stats.update(correction.metrics)
            kept = correction.response_mask.to(log_prob.dtype) if corr.rs_options else None
            if corr.loss_type == "reinforce":
                return rc.reinforce_loss(
                    mb.rollout_log_probs,
                    log_prob,
                    mb.advantages,
                    mb.response_mask,
                    weights=_times(correction.weights, kept),
                    loss_agg_mode=s.loss_agg_mode,
                    loss_scale_factor=s.loss_scale_factor,
                )
            weights = kept  # ppo_clip: the clipped ratio is the importance weight; rejected tokens weigh 0
        weighted = {} if weights is None else {"rollout_is_weights": weights}
        return self._pg_loss_fn(
            old_log_prob=old_log_prob,
            log_prob=log_prob,
            advantages=mb.advantages,
            response_mask=mb.response_mask,
            clip_ratio=s.clip_ratio,
            clip_ratio_low=s.clip_ratio_low,
            clip_ratio_high=s.clip_ratio_high,
            clip_ratio_c=s.clip_ratio_c,
            loss_agg_mode=s.loss_agg_mode,
            loss_scale_factor=s.loss_scale_factor,
            **({} if s.policy_loss_options is None else {"options": s.policy_loss_options}),
            **weighted,
        )

    def term_modes(self) -> list[str]:
        """The aggregation mode of each term :meth:`_loss_terms` returns, in order."""
        s = self.settings
        modes = [self._pg_agg_mode]
        modes += [s.loss_agg_mode] * ((s.entropy_coeff != 0) + s.use_kl_loss)
        return modes

    def graph_parts(self, mb: Batch, kl_loss_coef: float) -> MicroParts:
        """:meth:`_micro_loss` split for capture (:mod:`klppo.roles.graphed`): the packing planned here, on
        the host; the forward, the LM head and the loss a function of device tensors, the KL coefficient one
        of
        them. Packed rows only, no sequence parallelism, no ``full`` KL (the trainer's checks)."""
        s = self.settings
        mb = trim_left_padding(mb)
        inputs = prepare_log_probs(
            mb.input_ids,
            mb.attention_mask,
            mb.position_ids,
            response_length=mb.response_length,
            use_remove_padding=True,
            host_mask=mb.host_mask,
        )
        model_tensors, key, rebuild = split_inputs(inputs)
        present = tuple(f for f in LOSS_FIELDS if getattr(mb, f) is not None)
        device = mb.response_mask.device
        beta = torch.full((), kl_loss_coef, dtype=torch.float32, device=device)
        # an input, not a constant: the monitor may change it (RunControls.set_entropy_coeff) after capture
        entropy_coeff = torch.full((), s.entropy_coeff, dtype=torch.float32, device=device)
        n, m = len(model_tensors), len(present)

        def loss(ts):
            fields = SimpleNamespace(
                **(dict.fromkeys(LOSS_FIELDS) | dict(zip(present, ts[n : n + m], strict=True)))
            )
            log_prob, entropy = log_probs_of(
                self.model,
                rebuild(ts[:n]),
                temperature=s.temperature,
                calculate_entropy=True,
                fused=s.use_fused_kernels,
            )
            terms, stats = self._loss_terms(fields, log_prob, entropy, ts[n + m], entropy_coeff=ts[n + m + 1])
            stats.pop("actor/kl_coef", None)  # the host's float (host_stats), not the fp32 input
            return terms, stats

        tensors = [*model_tensors, *(getattr(mb, f) for f in present), beta, entropy_coeff]
        host = {"actor/kl_coef": kl_loss_coef} if s.use_kl_loss else {}
        return MicroParts(tensors, (key, present), self.term_modes(), loss, host)

    def _loss_terms(
        self,
        mb: Batch | SimpleNamespace,
        log_prob: torch.Tensor,
        entropy: torch.Tensor,
        kl_loss_coef: float | torch.Tensor,
        *,
        logits: torch.Tensor | None = None,
        ref_logits: torch.Tensor | None = None,
        entropy_coeff: float | torch.Tensor | None = None,
    ) -> tuple[LossTerms, dict[str, float | torch.Tensor]]:
        """The loss terms and statistics of a micro-batch from its log-probs and entropy (and, for the
        ``full`` KL, its logits and the reference's); ``mb`` gives the fields of ``LOSS_FIELDS``.
        ``entropy_coeff``: the bonus's coefficient (a graph's input tensor); None: ``settings.entropy_coeff``
        (whether there is a bonus term is always the settings' value, part of the graph's signature)."""
        s = self.settings
        if entropy_coeff is None:
            entropy_coeff = s.entropy_coeff
        mask = mb.response_mask
        stats = {}
        old_log_prob = mb.old_log_probs
        if old_log_prob is None:  # π_old: the behaviour policy in bypass mode, else the current policy
            old_log_prob = mb.rollout_log_probs if self.bypass_mode else log_prob.detach()
            stats.update(_skipped_pass_stats(log_prob.detach(), mb, s))  # (module docstring)
        pg_loss, pg_stats = self._policy_loss(mb, old_log_prob, log_prob, stats)
        terms: LossTerms = [(pg_loss, self._pg_agg_mode)]
        stats["actor/pg_loss"] = pg_loss.detach()
        stats.update({f"actor/{k}": v for k, v in pg_stats.items()})
        if s.entropy_coeff != 0:
            entropy_loss = losses.agg_loss(entropy, mask, s.loss_agg_mode, s.loss_scale_factor)
            terms.append((-entropy_coeff * entropy_loss, s.loss_agg_mode))
        else:
            entropy_loss = losses.agg_loss(entropy.detach(), mask, s.loss_agg_mode, s.loss_scale_factor)
        stats["actor/entropy"] = entropy_loss.detach()
        if s.use_kl_loss:
            if logits is not None:
                kl_mat = kl_mod.kl_penalty_full(logits, ref_logits, mask)
            else:
                kl_mat = kl_mod.kl_penalty(log_prob, mb.ref_log_probs, s.kl_loss_type)
            kl_loss = losses.agg_loss(kl_mat, mask, s.loss_agg_mode, s.loss_scale_factor)
            terms.append((kl_loss_coef * kl_loss, s.loss_agg_mode))
            stats["actor/kl_loss"] = kl_loss.detach()
            stats["actor/kl_coef"] = kl_loss_coef
        return terms, stats  # on the device: one transfer per update (roles/metrics.py)


HOST_SYNC_LOSS_MODES = ("clip_cov", "kl_cov")
"""Policy losses that read device values on the host (the number of tokens to clip): not capturable."""

LOSS_FIELDS = (
    "old_log_probs",
    "advantages",
    "response_mask",
    "ref_log_probs",
    "rollout_log_probs",
    "rollout_log_kept_mass",
    "rollout_is_weights",
)
"""The batch fields the actor's loss reads besides the model inputs."""


def _skipped_pass_stats(log_prob: torch.Tensor, mb: Batch, s: ActorSettings) -> dict[str, torch.Tensor]:
    """What the trainer reports after an old-log-prob pass, from the update's (pre-step) log-probs:
    ``rollout/log_prob_diff`` = mean |log π_θ − log π_rollout| (both full softmaxes, as the trainer's:
    :func:`klppo.batch.rollout_softmax_log_probs`), ``actor/ref_kl_k1`` = mean(log π_θ −
    log π_ref) and ``actor/ref_kl_k3`` over the response tokens (token means: the accumulator weights
    micro-batches by tokens)."""
    out = {}
    mask = mb.response_mask
    if mb.rollout_log_probs is not None:
        rollout = rollout_softmax_log_probs(mb)
        out["rollout/log_prob_diff"] = losses.masked_mean((log_prob - rollout).abs(), mask)
    if mb.ref_log_probs is not None:
        out["actor/ref_kl_k1"] = losses.masked_mean(log_prob - mb.ref_log_probs, mask)
        out["actor/ref_kl_k3"] = losses.masked_mean(kl_mod.kl_penalty(log_prob, mb.ref_log_probs, "k3"), mask)
        if s.use_kl_loss:  # what the KL-loss controller acts on (trainer/phases.py: measure_kl_for_control)
            kind = kl_mod.sampled_estimator(s.kl_loss_type)
            out["actor/kl_loss_ctrl_kl"] = losses.masked_mean(
                kl_mod.kl_penalty(log_prob, mb.ref_log_probs, kind), mask
            )
    return out


def _times(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """``a · b``, either factor absent (None) counting as 1."""
    return b if a is None else a if b is None else a * b
