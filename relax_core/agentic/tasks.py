"""Synthetic datasets for the example environments (``data.synthetic=calc`` / ``guess``) and the example
agent program (``calc_chat``).

The row is the task: its prompt is what the model reads first, its label and metadata reach the
environment's constructor.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING

from relax_core.agentic.lookup import lookup_value
from relax_core.data.synthetic import synthetic_task

if TYPE_CHECKING:
    from relax_core.config.schema import DataConfig


def operands(rng: random.Random, cfg: DataConfig) -> tuple[int, int]:
    """Two numbers of the same width, ``min_digits``..``max_digits`` digits."""
    width = rng.randint(cfg.min_digits, cfg.max_digits)
    return rng.randint(10 ** (width - 1), 10**width - 1), rng.randint(10 ** (width - 1), 10**width - 1)


@synthetic_task("calc")
def calc_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``37+45`` -> 82, with operands of ``min_digits``..``max_digits`` digits (too hard to add unaided)."""
    a, b = operands(rng, cfg)
    expr = f"{a}+{b}"
    return {"prompt": expr, "label": str(a + b), "metadata": {"expr": expr}}


@synthetic_task("guess")
def guess_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``417 guess 1-15``: find a secret in 1..15. The leading game number only makes prompts distinct, so
    the eval split (separated from train by prompt text) can hold every secret."""
    high = 15
    return {
        "prompt": f"{rng.randint(0, 999):03d} guess 1-{high}",
        "label": str(rng.randint(1, high)),
        "metadata": {"low": 1, "high": high},
    }


@synthetic_task("calc_chat")
def calc_chat_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``calc`` for the external agent program ``examples/agents/calc_agent.py``, with the conversation
    the program has with a model that solves it (``metadata.demo``, the warm-start demonstration)."""
    row = calc_row(rng, cfg)
    row["metadata"]["demo"] = [
        {"role": "assistant", "content": f"calc({row['prompt']})"},
        {"role": "tool", "content": f"={row['label']}"},
        {"role": "assistant", "content": row["label"]},
    ]
    return row


def _int_function(name: str, description: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }


# the functions examples/agents/calc_tools_agent.py offers (the chat template shows them to the model)
CALC_TOOLS = [_int_function("add", "a + b"), _int_function("mul", "a * b")]
TOOL_FOR_OPERATOR = {"+": "add", "*": "mul"}


@synthetic_task("calc_tools")
def calc_tools_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``7*5`` or ``7+5`` for the function-calling agent ``examples/agents/calc_tools_agent.py``, which
    offers ``add(a, b)`` and ``mul(a, b)`` and answers with the result of the model's call: reward 1 when
    the call uses the function that fits the operator (``metadata.tool``) on the question's numbers.

    The demonstration calls one of the two functions at random: it teaches the protocol (a call block
    with the question's numbers) but not which function fits, which is left to RL (the warm-start policy
    picks the right one about half the time)."""
    a, b = operands(rng, cfg)
    operator = rng.choice(sorted(TOOL_FOR_OPERATOR))
    demo_tool = rng.choice(sorted(TOOL_FOR_OPERATOR.values()))
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": demo_tool, "arguments": json.dumps({"a": a, "b": b})},
    }
    return {
        "prompt": f"{a}{operator}{b}",
        "label": str(a + b if operator == "+" else a * b),
        "metadata": {
            "expr": f"{a}{operator}{b}",
            "tool": TOOL_FOR_OPERATOR[operator],
            "tools": CALC_TOOLS,
            "demo": [{"role": "assistant", "content": None, "tool_calls": [call]}],
        },
    }


@synthetic_task("lookup")
def lookup_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``find 374`` -> the slow lookup service's value for key ``374`` (:mod:`relax_core.agentic.lookup`):
    keys of ``min_digits``..``max_digits`` digits, values a hash only the tool knows."""
    width = rng.randint(cfg.min_digits, cfg.max_digits)
    key = str(rng.randint(10 ** (width - 1), 10**width - 1))
    return {"prompt": f"find {key}", "label": lookup_value(key), "metadata": {"key": key}}
