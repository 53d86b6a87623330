"""Synthetic datasets for the example environments (``data.synthetic=calc`` / ``guess``) and the example
agent program (``calc_chat``).

The row is the task: its prompt is what the model reads first, its label and metadata reach the
environment's constructor.
"""

from __future__ import annotations

import json
import random

from relax_core.synthetic import synthetic_task


@synthetic_task("calc")
def calc_row(rng: random.Random, cfg) -> dict:
    """``37+45`` -> 82, with operands of ``min_digits``..``max_digits`` digits (too hard to add unaided)."""
    width = rng.randint(cfg.min_digits, cfg.max_digits)
    a, b = rng.randint(10 ** (width - 1), 10**width - 1), rng.randint(10 ** (width - 1), 10**width - 1)
    expr = f"{a}+{b}"
    return {"prompt": expr, "label": str(a + b), "metadata": {"expr": expr}}


@synthetic_task("guess")
def guess_row(rng: random.Random, cfg) -> dict:
    """``417 guess 1-15``: find a secret in 1..15. The leading game number only makes prompts distinct, so
    the eval split (separated from train by prompt text) can hold every secret."""
    high = 15
    return {
        "prompt": f"{rng.randint(0, 999):03d} guess 1-{high}",
        "label": str(rng.randint(1, high)),
        "metadata": {"low": 1, "high": high},
    }


@synthetic_task("calc_chat")
def calc_chat_row(rng: random.Random, cfg) -> dict:
    """``calc`` for the external agent program ``examples/agents/calc_agent.py``, with the conversation
    the program has with a model that solves it (``metadata.demo``, the warm-start demonstration)."""
    row = calc_row(rng, cfg)
    row["metadata"]["demo"] = [
        {"role": "assistant", "content": f"calc({row['prompt']})"},
        {"role": "tool", "content": f"={row['label']}"},
        {"role": "assistant", "content": row["label"]},
    ]
    return row


# the function examples/agents/calc_tools_agent.py offers (the chat template shows it to the model)
CALC_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an integer expression with +, - and *.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }
]


@synthetic_task("calc_tools")
def calc_tools_row(rng: random.Random, cfg) -> dict:
    """``calc`` for the function-calling agent ``examples/agents/calc_tools_agent.py``: the demonstration
    calls ``calc`` through ``tool_calls``, reads the tool's result and answers with it."""
    row = calc_row(rng, cfg)
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calc", "arguments": json.dumps({"expr": row["prompt"]})},
    }
    row["metadata"]["tools"] = CALC_TOOLS
    row["metadata"]["demo"] = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": row["label"]},
        {"role": "assistant", "content": row["label"]},
    ]
    return row
