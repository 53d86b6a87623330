"""A custom environment: the model must spell a word backwards, one letter per turn, with feedback.

Run it (from the repository root, so ``examples`` is importable by the Ray workers):

    PYTHONPATH=. python -m relax_launch experiment=agentic_calc \
        rollout.env._target_=examples.agentic.word_env.ReverseSpellEnv \
        data.synthetic=null data.train_path=examples/agentic/words.jsonl rollout.max_turns=6
"""

from __future__ import annotations

from typing import Any

from relax_core.agentic import BaseInteractionEnv


class ReverseSpellEnv(BaseInteractionEnv):
    """The dataset row's label is a word; turn k must be its k-th letter from the end.

    Each correct letter earns 1/len(word) (``info["reward"]`` is summed over the episode); a wrong letter
    ends the episode. ``expert_action`` lets ``trainer.sft_warmup_steps`` demonstrate the task.
    """

    def __init__(self, label: Any = None, metadata: dict | None = None, seed: int = 0) -> None:
        super().__init__(label, metadata, seed)
        self.target = str(label)[::-1]
        self.position = 0

    def reset(self) -> tuple[Any, dict[str, Any]]:
        return f"spell {self.label} backwards", {}

    def step(self, response_text: str) -> tuple[Any, bool, dict[str, Any]]:
        letter = response_text.strip()
        if letter != self.target[self.position]:
            return None, True, {"reward": 0.0, "acc": 0.0}
        self.position += 1
        done = self.position == len(self.target)
        info = {"reward": 1.0 / len(self.target), "acc": float(done)}
        return (None if done else "next"), done, info

    def format_observation(self, observation: Any) -> dict[str, Any]:
        # a tool-style message; with a chat template it renders as the model's tool role
        return {"role": "tool", "content": str(observation)}

    def expert_action(self) -> str:
        return self.target[self.position]
