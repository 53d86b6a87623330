"""Example environments that a 0.8M-parameter model learns on CPU (``experiment=agentic_calc`` / ``_guess``)."""

from __future__ import annotations

import re
from typing import Any

from relax_core.agentic.env import BaseInteractionEnv

CALL = re.compile(r"^calc\(([0-9+\-*]{1,32})\)$")
TERM = re.compile(r"^\d+([+\-*]\d+)*$")


def evaluate_expression(expr: str) -> int:
    """Integer value of ``a op b op c`` (+, -, * with the usual precedence); no eval() of model text."""
    if not TERM.match(expr):
        raise ValueError(f"not an arithmetic expression: {expr!r}")
    total = 0
    for part in re.split(r"(?=[+-])", expr):
        if not part:
            continue
        sign = -1 if part[0] == "-" else 1
        product = 1
        for factor in part.lstrip("+-").split("*"):
            product *= int(factor)
        total += sign * product
    return total


class CalculatorEnv(BaseInteractionEnv):
    """Tool use: answer ``37+45`` by first calling ``calc(37+45)``; the environment replies ``=82``.

    Any turn that is not a well-formed ``calc(...)`` call is the final answer. Reward 1 when it equals the
    label *and* the tool was called earlier in the episode (a correct guess without the tool earns 0).
    ``info``: ``tool_called`` and ``acc`` (final-answer correctness with the tool).
    """

    def __init__(self, label: Any = None, metadata: dict | None = None, seed: int = 0) -> None:
        super().__init__(label, metadata, seed)
        self.expr = self.metadata.get("expr", "")
        self.tool_calls = 0

    def step(self, response_text: str) -> tuple[Any, bool, dict[str, Any]]:
        text = response_text.strip()
        call = CALL.match(text)
        if call:
            self.tool_calls += 1
            try:
                return f"={evaluate_expression(call.group(1))}", False, {"tool_called": 1.0}
            except ValueError:
                return "=error", False, {"tool_called": 1.0}
        correct = text == str(self.label) and self.tool_calls > 0
        info = {"reward": float(correct), "acc": float(correct), "tool_called": float(self.tool_calls > 0)}
        return None, True, info

    def expert_action(self) -> str:
        return f"calc({self.expr})" if self.tool_calls == 0 else str(self.label)


class GuessingEnv(BaseInteractionEnv):
    """Find a secret integer in ``low..high``; after each wrong guess the environment says ``higher`` or
    ``lower`` (``invalid`` for a turn that is not a number). Reward 1 for finding it within the episode.

    The expert (warm-start demonstrations) bisects the interval the feedback leaves open.
    """

    def __init__(
        self, label: Any = None, metadata: dict | None = None, seed: int = 0, low: int = 1, high: int = 15
    ) -> None:
        super().__init__(label, metadata, seed)
        self.secret = int(label)
        self.low, self.high = int(self.metadata.get("low", low)), int(self.metadata.get("high", high))
        self.guesses = 0

    def step(self, response_text: str) -> tuple[Any, bool, dict[str, Any]]:
        self.guesses += 1
        text = response_text.strip()
        if not text.isdigit():
            return "invalid", False, {"reward": 0.0, "acc": 0.0}
        guess = int(text)
        if guess == self.secret:
            return None, True, {"reward": 1.0, "acc": 1.0, "guesses": float(self.guesses)}
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
            return "higher", False, {"reward": 0.0, "acc": 0.0}
        self.high = min(self.high, guess - 1)
        return "lower", False, {"reward": 0.0, "acc": 0.0}

    def expert_action(self) -> str:
        return str((self.low + self.high) // 2)
