"""Supervised warm-start data for agentic runs: expert episodes played against the real environment.

The environment's :meth:`~relax_core.agentic.env.BaseInteractionEnv.expert_action` plays the model's
turns (each followed by EOS), and the same runner that does RL rollouts lays the episode out as tokens,
so demonstrations and rollouts share one format: expert turns have loss mask 1, observations 0, and the
warm-start loss (mean NLL over masked tokens) learns only the agent's side.
"""

from __future__ import annotations

from relax_core.agentic.multiturn import Episode, MultiTurnRunner
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord, Sample


def expert_policy(tokenizer):
    eos = tokenizer.eos_token_id

    def policy(episodes: list[Episode], budget_cap: int):
        out = []
        for ep in episodes:
            try:
                text = ep.env.expert_action()
            except NotImplementedError as err:
                raise RelaxUserError(
                    f"trainer.sft_warmup_steps>0 with rollout.env needs demonstrations: {err} "
                    "(implement expert_action, or set trainer.sft_warmup_steps=0)"
                ) from None
            ids = tokenizer(text or "", add_special_tokens=False).input_ids + [eos]
            out.append((ids, [0.0] * len(ids), "stop", 0))
        return out

    return policy


def expert_samples(prompts: list[PromptRecord], rollout_cfg, tokenizer, seed: int) -> list[Sample]:
    """One demonstration episode per prompt (failed ones, e.g. over the context budget, are dropped)."""
    runner = MultiTurnRunner(rollout_cfg, tokenizer, seed=seed)
    samples = runner.run(prompts, 1, expert_policy(tokenizer))
    return [s for s in samples if any(s.loss_mask)]
