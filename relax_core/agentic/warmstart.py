"""Supervised warm-start data for agentic runs: expert episodes played against the real environment.

The environment's :meth:`~relax_core.agentic.env.BaseInteractionEnv.expert_action` plays the model's
turns (each followed by EOS), and the same runner that does RL rollouts lays the episode out as tokens,
so demonstrations and rollouts share one format: expert turns have loss mask 1, observations 0, and the
warm-start loss (mean NLL over masked tokens) learns only the agent's side.

An external agent program (``rollout.agent``) has no environment in the run: its rows carry the
demonstration instead (``metadata.demo``: the messages after the prompt), laid out as the agent endpoint
records a session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_core.agentic.formatting import continuation_text, render_messages
from relax_core.agentic.multiturn import Episode, MultiTurnRunner
from relax_core.agentic.tools import assistant_text
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord, Sample

if TYPE_CHECKING:
    from relax_core.config.schema import RolloutConfig


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


def expert_samples(
    prompts: list[PromptRecord], rollout_cfg: RolloutConfig, tokenizer, seed: int
) -> list[Sample]:
    """One demonstration episode per prompt (failed ones, e.g. over the context budget, are dropped)."""
    runner = MultiTurnRunner(rollout_cfg, tokenizer, seed=seed)
    samples = runner.run(prompts, 1, expert_policy(tokenizer))
    return [s for s in samples if any(s.loss_mask)]


def demo_samples(prompts: list[PromptRecord], tokenizer) -> list[Sample]:
    """One sample per prompt from its ``metadata["demo"]`` messages, token for token as the endpoint
    records them: assistant turns plus EOS (mask 1), the messages a program adds between them (mask 0)."""
    eos = tokenizer.eos_token_id

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    samples = []
    for p in prompts:
        demo = p.metadata.get("demo")
        if not demo:
            raise RelaxUserError(
                f"trainer.sft_warmup_steps>0 with rollout.agent needs metadata.demo (the messages after the "
                f"prompt) in every row; row {p.index} has none (or set trainer.sft_warmup_steps=0)"
            )
        conversation, prompt_ids, ids, mask, last_turn = list(p.messages), None, [], [], None
        tools = p.metadata.get("tools")  # the functions the program offers, as in its requests
        for message in demo:
            if message["role"] == "assistant":
                if last_turn is None:
                    prompt_ids = encode(render_messages(tokenizer, conversation, tools=tools))
                elif len(conversation) > last_turn + 1:
                    added = encode(
                        continuation_text(
                            tokenizer, conversation[:last_turn], conversation[last_turn + 1 :], True, tools
                        )
                    )
                    ids, mask = ids + added, mask + [0] * len(added)
                turn = encode(assistant_text(message)) + [eos]
                ids, mask, last_turn = ids + turn, mask + [1] * len(turn), len(conversation)
            conversation.append(message)
        if prompt_ids is None:
            raise RelaxUserError(f"row {p.index}: metadata.demo has no assistant message")
        samples.append(Sample(p.index, 0, prompt_ids, ids, [0.0] * len(ids), mask))
    return samples
