"""klppo.algorithms: the KL-PPO math as pure functions on tensors.

KL estimators and the KL penalty in the reward (:mod:`.kl`), KL coefficient controllers
(:mod:`.kl_control`), advantage estimators (:mod:`.advantages`; group outcome estimators in
:mod:`.outcome`), policy/value/KL losses and entropy (:mod:`.losses`; policy-loss variants in
:mod:`.policy_losses`), loss aggregation (:mod:`.aggregate`), masked reductions (:mod:`.masked`), the laws
a rollout samples from, truncated ones included (:mod:`.sampling`). Formulas, config keys and papers:
``docs/algorithms.md``.

Knows nothing of torch.distributed, models or the config: inputs are tensors, floats and strings.
"""

from klppo.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    compute_advantages,
    gae,
    get_advantage_estimator,
    gpg,
    grpo,
    grpo_passk,
    needs_critic,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from klppo.algorithms.kl import KL_KINDS, apply_kl_penalty, kl_penalty, kl_penalty_full
from klppo.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    KLController,
    make_kl_controller,
)
from klppo.algorithms.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_KEYS,
    POLICY_LOSSES,
    agg_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_loss,
    policy_loss,
    policy_loss_agg_mode,
    value_loss,
)
from klppo.algorithms.masked import explained_variance, masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_KEYS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "KLController",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantages",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "get_advantage_estimator",
    "get_policy_loss",
    "gpg",
    "grpo",
    "grpo_passk",
    "kl_loss",
    "kl_penalty",
    "kl_penalty_full",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "needs_critic",
    "opo",
    "policy_loss",
    "policy_loss_agg_mode",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "value_loss",
]
