"""Relax reward hub: verifiers behind one interface (``get``/``available``), plug-ins and an executor.

Example::

    import relax_rewards
    fn = relax_rewards.get("math")  # fn(response, label, metadata=None) -> float | dict
    relax_rewards.available()  # names of the registered rewards

    @relax_rewards.register("my_reward")  # add your own
    def my_reward(response, label, metadata=None): ...

    fn = relax_rewards.load_custom("pkg.mod.fn")  # or "path/to/file.py:fn"

    ex = relax_rewards.RewardExecutor.from_config(cfg.reward)  # timeouts, isolation, process pool
    outcomes = ex.score([relax_rewards.RewardItem("s0", response, label, metadata, group_id=0)])
"""

from relax_rewards import builtin, code, digits  # noqa: F401  (registers the built-in rewards)
from relax_rewards.config import RewardConfig
from relax_rewards.executor import RewardExecutor, RewardItem, RewardOutcome
from relax_rewards.plugins import group_reward, is_group_reward, load_custom
from relax_rewards.registry import RewardEntry, UnknownRewardError, available, get, get_entry, register

__all__ = [
    "RewardConfig",
    "RewardEntry",
    "RewardExecutor",
    "RewardItem",
    "RewardOutcome",
    "UnknownRewardError",
    "available",
    "get",
    "get_entry",
    "group_reward",
    "is_group_reward",
    "load_custom",
    "register",
]
