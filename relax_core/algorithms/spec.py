"""What each algorithm needs, declared once; :func:`requirements` is what the engine reads.

Three layers of records, because a user composes algorithms from parts
(``algorithm=grpo algorithm.advantage_estimator=rloo`` is a valid run):

- :class:`EstimatorSpec` per advantage estimator: group-local or batch-wide, the smallest prompt group it
  works with, whether it reads Critic values or a reward-side KL;
- constraints per policy loss and loss aggregation (:data:`POLICY_LOSS_RULES`, :data:`LOSS_AGG_RULES`);
- :class:`AlgorithmSpec` per ``conf/algorithm/<name>.yaml``: the parts that algorithm picks and the roles
  it brings. Its fields carry the config key names, and a test checks each against its yaml.

:func:`requirements` answers from the *configured* parts, so an override is covered the same way as a
shipped algorithm. Validation (``relax_core.algorithms.checks``) reads the same records.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax_core.algorithms.registry import Registry
from relax_core.errors import RelaxUserError

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig

# per-token fields helper roles write for the Advantages and Actor stages
VALUES, TEACHER_LOGPROBS, REF_LOGPROBS, OLD_LOGPROBS = (
    "values",
    "teacher_logprobs",
    "ref_logprobs",
    "old_logprobs",
)


@dataclass(frozen=True)
class Constraint:
    """``holds(cfg.algorithm, cfg.rollout)`` must be true; else ``message`` (one line naming the key,
    formatted with ``a=cfg.algorithm, r=cfg.rollout``) is the user's error."""

    holds: Callable[[Any, Any], bool]
    message: str

    def check(self, cfg: RelaxConfig) -> None:
        a, r = cfg.algorithm, cfg.rollout
        if not self.holds(a, r):
            raise RelaxUserError(self.message.format(a=a, r=r))


def _always(a) -> bool:
    return True


@dataclass(frozen=True)
class GroupNeed:
    """``rollout.n_samples_per_prompt >= size`` whenever ``applies(cfg.algorithm)``; ``why`` says what for."""

    size: int
    why: str
    applies: Callable[[Any], bool] = _always
    subject: str = "algorithm {a.name} ({a.advantage_estimator})"

    def constraint(self) -> Constraint:
        return Constraint(
            lambda a, r: not self.applies(a) or r.n_samples_per_prompt >= self.size,
            f"{self.subject} needs rollout.n_samples_per_prompt >= {self.size} ({self.why}), "
            "got {r.n_samples_per_prompt}",
        )


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    # a sample's advantage depends only on its own prompt group: computed as each group lands
    group_local: bool
    group_need: GroupNeed | None = None
    # reads the Critic's per-token values (GAE)
    values: bool = False
    # takes algorithm.kl_reward_coef: a per-token KL against the Reference in the reward
    reward_kl: bool = False


ESTIMATOR_SPECS: Registry[EstimatorSpec] = Registry("advantage estimator spec")
for _spec in (
    # with or without the std division (Dr. GRPO): a group of one is its own mean, so A = 0
    EstimatorSpec("grpo", group_local=True, group_need=GroupNeed(2, "a group to normalise over")),
    EstimatorSpec("rloo", group_local=True, group_need=GroupNeed(2, "a leave-one-out baseline")),
    EstimatorSpec("reinforce", group_local=True),
    EstimatorSpec("reinforce_pp", group_local=False, reward_kl=True),  # whitened over the batch
    EstimatorSpec(
        "reinforce_pp_baseline",
        group_local=False,
        group_need=GroupNeed(2, "a group-mean baseline"),
        reward_kl=True,
    ),
    EstimatorSpec("gae", group_local=False, values=True),
):
    ESTIMATOR_SPECS.add(_spec.name, _spec)

# DAPO's dynamic sampling keeps only groups whose rewards differ: a group of one never does
DYNAMIC_SAMPLING_NEED = GroupNeed(
    2, "reward spread", lambda a: a.dynamic_sampling, subject="algorithm.dynamic_sampling"
)

POLICY_LOSS_RULES: dict[str, tuple[Constraint, ...]] = {
    "sapo": (
        Constraint(
            lambda a, r: a.tau_pos > 0 and a.tau_neg > 0,
            "algorithm.tau_pos and algorithm.tau_neg (SAPO gate temperatures) must be > 0, got {a.tau_pos}, {a.tau_neg}",
        ),
    ),
}
LOSS_AGG_RULES: dict[str, tuple[Constraint, ...]] = {
    "seq-mean-token-sum-norm": (
        Constraint(
            lambda a, r: a.loss_scale is None or a.loss_scale > 0,
            "algorithm.loss_scale must be > 0 for seq-mean-token-sum-norm (Dr. GRPO's constant), got {a.loss_scale}",
        ),
    ),
}


@dataclass(frozen=True)
class AlgorithmSpec:
    """One shipped algorithm: the parts its ``conf/algorithm/<name>.yaml`` picks and the roles it brings.
    Field names are the config keys they mirror."""

    name: str
    advantage_estimator: str
    policy_loss: str = "ppo_clip"
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = False
    dynamic_sampling: bool = False
    # roles beyond Rollout/Actor/Advantages: a value model (algorithm.critic), a frozen teacher
    # (algorithm.teacher), the Reference for a reward-side KL on by default (algorithm.kl_reward_coef > 0)
    critic: bool = False
    teacher: bool = False
    reward_kl: bool = False

    @property
    def estimator(self) -> EstimatorSpec:
        return ESTIMATOR_SPECS.get(self.advantage_estimator)

    @property
    def group_local(self) -> bool:
        return self.estimator.group_local

    @property
    def min_group_size(self) -> int:
        return _min_group_size(self)

    def constraints(self) -> tuple[Constraint, ...]:
        """The roles this algorithm brings must stay configured."""
        rules = []
        if self.critic:
            rules.append(
                Constraint(lambda a, r: a.critic is not None, "algorithm {a.name} needs algorithm.critic")
            )
        if self.teacher:
            rules.append(
                Constraint(lambda a, r: a.teacher is not None, "algorithm {a.name} needs algorithm.teacher")
            )
        return tuple(rules)


ALGORITHM_SPECS: Registry[AlgorithmSpec] = Registry("algorithm spec")
for _spec in (
    AlgorithmSpec("grpo", "grpo", norm_adv_by_std=True),
    AlgorithmSpec("dr_grpo", "grpo", loss_agg_mode="seq-mean-token-sum-norm"),
    AlgorithmSpec("dapo", "grpo", norm_adv_by_std=True, dynamic_sampling=True),
    AlgorithmSpec("gspo", "grpo", "gspo", "seq-mean-token-mean", norm_adv_by_std=True),
    AlgorithmSpec("sapo", "grpo", "sapo", norm_adv_by_std=True),
    AlgorithmSpec("cispo", "grpo", "cispo", norm_adv_by_std=True),
    AlgorithmSpec("rloo", "rloo"),
    AlgorithmSpec("reinforce", "reinforce"),
    AlgorithmSpec("reinforce_pp", "reinforce_pp", reward_kl=True),
    AlgorithmSpec("reinforce_pp_baseline", "reinforce_pp_baseline", reward_kl=True),
    AlgorithmSpec("ppo", "gae", critic=True),
    AlgorithmSpec("opd", "grpo", norm_adv_by_std=True, teacher=True),
):
    ALGORITHM_SPECS.add(_spec.name, _spec)


def group_needs(a) -> list[GroupNeed]:
    """Prompt-group sizes the configured algorithm ``a`` (a config or an :class:`AlgorithmSpec`) relies on."""
    estimator = ESTIMATOR_SPECS.get(a.advantage_estimator).group_need
    return [need for need in (estimator, DYNAMIC_SAMPLING_NEED) if need is not None and need.applies(a)]


def _min_group_size(a) -> int:
    return max([need.size for need in group_needs(a)], default=1)


def constraints(a) -> list[Constraint]:
    """Every rule the configured parts of ``a`` (cfg.algorithm) bring: group sizes, estimator, loss,
    aggregation, and the shipped algorithm's roles when ``a.name`` is one."""
    estimator = ESTIMATOR_SPECS.get(a.advantage_estimator)
    rules = [need.constraint() for need in group_needs(a)]
    if estimator.values:
        rules.append(
            Constraint(
                lambda a, r: a.critic is not None,
                "advantage_estimator={a.advantage_estimator} needs a value model: set algorithm.critic (e.g. algorithm=ppo)",
            )
        )
    if not estimator.reward_kl:
        rules.append(
            Constraint(
                lambda a, r: not a.kl_reward_coef > 0,
                "algorithm.kl_reward_coef (reward-side KL) is used by the reinforce_pp estimators, not {a.advantage_estimator!r}",
            )
        )
    rules += POLICY_LOSS_RULES.get(a.policy_loss, ())
    rules += LOSS_AGG_RULES.get(a.loss_agg_mode, ())
    if a.name in ALGORITHM_SPECS.names():
        rules += ALGORITHM_SPECS.get(a.name).constraints()
    return rules


@dataclass(frozen=True)
class Requirements:
    """What one run needs from the engine, decided from its config alone."""

    # the Reference role: a KL loss term or a reward-side KL penalty
    reference: bool
    critic: bool
    teacher: bool
    # the behaviour policy's log-probs need their own forward before training (several optimizer steps
    # per rollout batch); otherwise old log-probs = the detached current ones
    actor_fwd: bool
    # per-token fields the Advantages stage waits for besides the Rollout's
    advantage_inputs: tuple[str, ...]
    # advantages of a prompt group can be computed as soon as that group lands
    group_local: bool
    min_group_size: int
    # per-token fields the Actor trains on
    train_fields: tuple[str, ...]
    # helper roles that hold a model, in launch order (ActorFwd is its own role in mode=async only;
    # mode=colocate runs that forward on the Actor)
    model_roles: tuple[str, ...]


def needs_old_logprobs(cfg: RelaxConfig, num_samples: int) -> bool:
    """A batch of ``num_samples`` is trained in several optimizer steps (``ppo_epochs > 1`` or
    ``trainer.global_batch_size`` below it), so later steps need the behaviour policy's log-probs."""
    global_batch = cfg.trainer.global_batch_size
    return cfg.algorithm.ppo_epochs > 1 or bool(global_batch and global_batch < num_samples)


def requirements(cfg: RelaxConfig) -> Requirements:
    a, r = cfg.algorithm, cfg.rollout
    estimator = ESTIMATOR_SPECS.get(a.advantage_estimator)
    reference = a.kl_loss_coef > 0 or a.kl_reward_coef > 0
    critic, teacher = a.critic is not None, a.teacher is not None
    actor_fwd = needs_old_logprobs(cfg, r.batch_size * r.n_samples_per_prompt)
    reward_kl = a.kl_reward_coef > 0
    inputs = (VALUES,) * critic + (TEACHER_LOGPROBS,) * teacher + (REF_LOGPROBS,) * reward_kl
    # distillation and the reward-side KL compare against the behaviour policy's log-probs
    inputs += (OLD_LOGPROBS,) * (actor_fwd and (teacher or reward_kl))
    fwd_role = actor_fwd and cfg.mode.name == "async"
    roles = [("actor_fwd", fwd_role), ("reference", reference), ("critic", critic), ("teacher", teacher)]
    return Requirements(
        reference=reference,
        critic=critic,
        teacher=teacher,
        actor_fwd=actor_fwd,
        advantage_inputs=inputs,
        group_local=estimator.group_local,
        min_group_size=_min_group_size(a),
        train_fields=("advantages",) + (REF_LOGPROBS,) * reference + (OLD_LOGPROBS,) * actor_fwd,
        model_roles=tuple(name for name, needed in roles if needed),
    )
