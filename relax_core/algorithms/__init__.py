"""Pure tensor functions of RL post-training, registered by name.

Importing this package registers every estimator, loss, KL and aggregation; an algorithm config
(``conf/algorithm/*.yaml``) selects them by name.
"""

from relax_core.algorithms import advantages, aggregation, kl, policy_loss, shaping  # noqa: F401  (registration)
from relax_core.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
)

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_ESTIMATORS", "LOSS_AGGREGATIONS", "POLICY_LOSSES"]
