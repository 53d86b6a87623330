"""Held-out evaluation over the named sets of ``eval.sets``: greedy accuracy, sampled pass@k / maj@k.

``Evaluator`` loads every set's prompts (and its reward, when the set has its own) once, and scores a model
through any ``generate(prompts, greedy, sampling)`` — a mode's (relax_core/modes/), so training runs and
eval-only runs (relax_launch/eval.py) evaluate on the same engines. Metrics are ``eval/<set>/...``; the
primary set's greedy accuracy and reward are also ``eval/accuracy`` and ``eval/reward``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import OmegaConf

from relax_core.config.schema import EvalSetConfig, RelaxConfig
from relax_core.data.prompts import load_prompts
from relax_core.engines.base import SamplingParams
from relax_core.errors import RelaxUserError, RunFailedError
from relax_core.evaluation.metrics import answer_key, length_stats, sampled_metrics
from relax_core.resilience.health import apply_reward
from relax_core.samples import PromptRecord, Sample
from relax_rewards.config import RewardConfig
from relax_rewards.executor import RewardExecutor, RewardItem

log = logging.getLogger("relax")

ANSWER_KINDS = ("text", "boxed", "number")
Generate = Callable[..., list[Sample]]


def solved(sample: Sample) -> float:
    """How far a response solves its prompt: the reward's ``acc`` entry when it has one, else reward ≥ 1
    (pass@k and maj@k count it correct at 1)."""
    return (
        float(sample.reward_extras["acc"]) if "acc" in sample.reward_extras else float(sample.reward >= 1.0)
    )


def eval_sets(cfg: RelaxConfig) -> dict[str, EvalSetConfig]:
    """``eval.sets`` checked against :class:`EvalSetConfig`; a bad entry raises one line naming its key."""
    sets: dict[str, EvalSetConfig] = {}
    eval_every = cfg.trainer.eval_every
    for name, fields in cfg.eval.sets.items():
        where = f"eval.sets.{name}"
        if "/" in name:
            raise RelaxUserError(
                f"{where}: a set name cannot contain '/' (it names the metrics eval/<set>/...)"
            )
        try:
            node = OmegaConf.merge(OmegaConf.structured(EvalSetConfig), fields or {})
            s: EvalSetConfig = OmegaConf.to_object(node)
        except Exception as err:  # noqa: BLE001  (OmegaConf raises several types, all for the user's input)
            key = getattr(err, "full_key", None)
            raise RelaxUserError(f"{where}{'.' + key if key else ''}: {str(err).splitlines()[0]}") from None
        if s.n_samples < 0 or any(k < 1 for k in s.k):
            raise RelaxUserError(
                f"{where}: n_samples must be >= 0 and every k >= 1 (got {s.n_samples}, {s.k})"
            )
        if s.n_samples and not any(k <= s.n_samples for k in s.k):
            raise RelaxUserError(f"{where}.k: no k in {s.k} is <= n_samples={s.n_samples}")
        if s.n_samples and s.temperature <= 0:
            raise RelaxUserError(
                f"{where}.temperature: the sampled pass needs temperature > 0 (greedy: true)"
            )
        if s.answer not in ANSWER_KINDS:
            raise RelaxUserError(f"{where}.answer: {s.answer!r} is not one of {', '.join(ANSWER_KINDS)}")
        for key in ("every", "sampled_every"):
            value = getattr(s, key)
            if value and (value < 0 or (eval_every and value % eval_every)):
                raise RelaxUserError(
                    f"{where}.{key}={value}: must be a multiple of trainer.eval_every={eval_every}"
                )
        sets[name] = s
    if sets and cfg.eval.primary not in sets:
        raise RelaxUserError(f"eval.primary={cfg.eval.primary!r}: not a set of eval.sets ({', '.join(sets)})")
    return sets


def with_run_judge(reward: RewardConfig, run_reward: RewardConfig) -> RewardConfig:
    """An eval set's genrm reward with no judge of its own asks the run's: the URL the run's ``reward.judge``
    router took, or the run's ``reward.kwargs.url``."""
    url = run_reward.kwargs.get("url") if run_reward.name == "genrm" else None
    if reward.name != "genrm" or reward.kwargs.get("url") or reward.judge is not None or not url:
        return reward
    return replace(reward, kwargs={**reward.kwargs, "url": url})


@dataclass
class EvalSet:
    name: str
    cfg: EvalSetConfig
    prompts: list[PromptRecord]
    # the set's own reward (``eval.sets.<name>.reward``); None: the engines' scores stand
    reward: RewardConfig | None
    # its executor, started at the set's first scoring: the run's judge is up by then
    rewards: RewardExecutor | None = None


class Evaluator:
    def __init__(self, cfg: RelaxConfig, tokenizer, media, default_path: str | None) -> None:
        """Load every set; a set without a file (no ``path`` and no eval split in the data config) is
        left out, as a run without ``data.eval_path`` has always had no evaluation."""
        self.cfg = cfg
        self.primary = cfg.eval.primary
        self.sets: dict[str, EvalSet] = {}
        for name, s in eval_sets(cfg).items():
            path = s.path or default_path
            if not path:
                continue
            data = replace(
                cfg.data,
                prompt_key=s.prompt_key or cfg.data.prompt_key,
                label_key=s.label_key or cfg.data.label_key,
                system_prompt=s.system_prompt if s.system_prompt is not None else cfg.data.system_prompt,
            )
            split = s.split or cfg.data.eval_split
            prompts = load_prompts(path, data, tokenizer, media, s.prompt_template, split, s.limit)[0]
            self.sets[name] = EvalSet(name, s, prompts, s.reward)
        # agent programs play episodes at the rollout's own sampling: no sampled pass there. In a training
        # run the sampled pass must leave the training draws as they were, which only the torch engine's
        # generator allows (vLLM/SGLang servers and multi-turn environments keep RNG state of their own);
        # eval-only runs (evaluate_only) have no training draws to keep
        self.sampled_ok = cfg.rollout.agent is None
        self.sampled_in_training = cfg.rollout.engine == "torch" and cfg.rollout.env is None
        if (
            self.sampled_ok
            and not self.sampled_in_training
            and any(s.cfg.n_samples for s in self.sets.values())
        ):
            log.info(
                "eval: no sampled pass (pass@k, maj@k) during training with rollout.engine=%s%s; "
                "python -m relax_launch.eval scores the final model with it",
                cfg.rollout.engine,
                " and rollout.env" if cfg.rollout.env is not None else "",
            )
            self.sampled_ok = False

    def due(self, step: int) -> bool:
        """Whether any set evaluates after RL step ``step``."""
        return any(
            self._greedy_due(s.cfg, step) or self._sampled_due(s.cfg, step) for s in self.sets.values()
        )

    def _greedy_due(self, s: EvalSetConfig, step: int) -> bool:
        return s.greedy and (step in (0, self.cfg.trainer.total_steps) or not s.every or step % s.every == 0)

    def _sampled_due(self, s: EvalSetConfig, step: int) -> bool:
        if not s.n_samples or not self.sampled_ok:
            return False
        return step in (0, self.cfg.trainer.total_steps) or bool(
            s.sampled_every and step % s.sampled_every == 0
        )

    def run(self, generate: Generate, step: int) -> dict[str, float]:
        """Evaluate the sets due after ``step`` (0: before RL; ``trainer.total_steps``: all of them, sampled
        pass included) with ``generate``; ``eval/weight_version_min|max`` say which weights answered."""
        out: dict[str, float] = {}
        versions: list[int] = []
        for es in self.sets.values():
            s, prefix = es.cfg, f"eval/{es.name}"
            budget = s.max_new_tokens or self.cfg.rollout.max_new_tokens
            if self._greedy_due(s, step):
                # the engines' own greedy sampling unless the set has its own response budget
                greedy = SamplingParams(budget, temperature=0.0) if s.max_new_tokens else None
                samples = self._score(es, generate(es.prompts, True, greedy), step)
                versions += [x.policy_version for x in samples]
                out[f"{prefix}/accuracy"] = sum(map(solved, samples)) / len(samples)
                out[f"{prefix}/reward"] = sum(x.reward for x in samples) / len(samples)
                out |= length_stats([len(x.response_ids) for x in samples], f"{prefix}/response_len")
                if es.name == self.primary:
                    out["eval/accuracy"], out["eval/reward"] = (
                        out[f"{prefix}/accuracy"],
                        out[f"{prefix}/reward"],
                    )
            if self._sampled_due(s, step):
                out |= self._sampled(es, generate, step, budget, versions)
        if versions:
            out["eval/weight_version_min"], out["eval/weight_version_max"] = min(versions), max(versions)
        return out

    def _sampled(self, es: EvalSet, generate: Generate, step: int, budget: int, versions: list[int]) -> dict:
        s, prefix = es.cfg, f"eval/{es.name}"
        # its own seed per (run seed, step, set): the training sampling stream is left where it was
        seed = (self.cfg.seed * 1_000_003 + step * 7919 + list(self.sets).index(es.name)) % 2**63
        sampling = SamplingParams(
            budget, s.temperature, s.top_p, self.cfg.rollout.top_k, n=s.n_samples, seed=seed
        )
        samples = self._score(es, generate(es.prompts, False, sampling), step)
        versions += [x.policy_version for x in samples]
        groups = []
        for i in range(0, len(samples), s.n_samples):
            group = samples[i : i + s.n_samples]
            answers = [answer_key(x.response_text, s.answer) for x in group]
            groups.append(([solved(x) >= 1.0 for x in group], [x.reward for x in group], answers))
        out = {f"{prefix}/{k}": v for k, v in sampled_metrics(groups, s.k).items()}
        out |= length_stats([len(x.response_ids) for x in samples], f"{prefix}/sampled_len")
        log.info(
            "eval %s at step %d (%d×%d samples): %s",
            es.name,
            step,
            len(es.prompts),
            s.n_samples,
            " | ".join(f"{k.rsplit('/', 1)[1]} {v:.3f}" for k, v in out.items() if "@" in k),
        )
        return out

    def _score(self, es: EvalSet, samples: list[Sample], step: int) -> list[Sample]:
        """``samples`` scored by the set's own reward (else the engines' scores stand). Before RL (step 0),
        a pass whose every sample is a reward error stops the run: the rest of the evaluation, and every
        step after it, would score nothing but errors (a reward that times out costs its timeout each)."""
        reward = es.reward or self.cfg.reward
        if es.reward is not None:
            if es.rewards is None:
                es.rewards = RewardExecutor.from_config(with_run_judge(es.reward, self.cfg.reward))
            items = [RewardItem(x.uid, x.response_text, x.label, x.metadata, x.group_id) for x in samples]
            for x, outcome in zip(samples, es.rewards.score(items), strict=True):
                apply_reward(x, outcome, reward.max_abs)
        if step == 0 and samples and all(x.reward_extras.get("reward_error") for x in samples):
            first, key = samples[0], "reward" if es.reward is None else f"eval.sets.{es.name}.reward"
            error = (first.metadata or {}).get("reward_error")
            if error == "timeout":
                error = (
                    f"timed out ({key}.timeout_s={reward.timeout_s:g}: raise it if the reward is only slow)"
                )
            raise RunFailedError(
                f"eval set {es.name} before RL: all {len(samples)} samples are reward errors of reward "
                f"{reward._target_ or reward.name!r}; the first, sample {first.uid}: {error}"
            )
        return samples

    def close(self) -> None:
        for es in self.sets.values():
            if es.rewards is not None:
                es.rewards.close()

    def summary(self, metrics: dict[str, Any]) -> dict[str, dict[str, float]]:
        """``{set: {metric: value}}`` of one evaluation's metrics (the summary's per-set view)."""
        return {
            name: {k.split("/", 2)[2]: v for k, v in metrics.items() if k.startswith(f"eval/{name}/")}
            for name in self.sets
        }
