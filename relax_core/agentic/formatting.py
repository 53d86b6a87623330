"""Observation messages -> tokens appended to a multi-turn context (chat template or plain text).

With a chat template, an observation's text is what the template puts after an assistant turn for the
new message, found by rendering a conversation around a sentinel assistant reply; the model's own end
token (EOS) that closes its turn is already in the context, so the template's copy of it is dropped.
Without a template (the tiny character tokenizer) an observation is its text plus a newline.
Images in an observation are expanded by the model's processor and their tensors are appended to the
sample's multimodal inputs, so later turns (and training) see every image of the episode.
"""

from __future__ import annotations

from typing import Any

import torch

from relax_core.agentic.tools import assistant_text
from relax_core.errors import RelaxUserError

SENTINEL = "\u2063RELAX_TURN\u2063"
IMAGE_MARKER = "<image>"
# tensors that grow by concatenation along dim 0 when a turn adds media
_CONCAT_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def render_messages(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text of a conversation: the chat template (with a generation prompt and the ``tools`` offered),
    or, without one, each message's content followed by EOS (assistant turns, as the model ends them, tool
    calls written in the family's convention) or a newline (others)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    eos = tokenizer.eos_token or ""
    return "".join(
        assistant_text(m) + eos if m.get("role") == "assistant" else str(m.get("content") or "") + "\n"
        for m in messages
    )


def continuation_text(
    tokenizer,
    history: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    ended_with_eos: bool,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The text that follows the model's last turn when ``new_messages`` join the conversation.

    ``history`` ends before that assistant turn. The turn is rendered as a sentinel so the template's own
    closing of it (EOS, newlines) is kept; the EOS the model itself generated is already in the context.
    """
    rendered = render_messages(
        tokenizer, [*history, {"role": "assistant", "content": SENTINEL}, *new_messages], tools=tools
    )
    tail = rendered.split(SENTINEL, 1)[1]
    eos = tokenizer.eos_token or ""
    if ended_with_eos and eos and tail.startswith(eos):
        tail = tail[len(eos) :]
    return tail


class ObservationFormatter:
    def __init__(self, tokenizer, model_path: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.use_chat = bool(getattr(tokenizer, "chat_template", None))
        self._processor = None

    def text(self, message: dict[str, Any], ended_with_eos: bool = True) -> str:
        """The context text an observation message adds after a model turn."""
        content = str(message.get("content", ""))
        images = message.get("images") or []
        if images and IMAGE_MARKER not in content:
            content = IMAGE_MARKER * len(images) + content
        msg = {"role": message.get("role", "user"), "content": content}
        return continuation_text(self.tokenizer, [{"role": "user", "content": "x"}], [msg], ended_with_eos)

    def encode(
        self, message: dict[str, Any], ended_with_eos: bool = True
    ) -> tuple[list[int], dict[str, torch.Tensor] | None]:
        """Token ids of the observation and, when it carries images, their processor tensors."""
        text = self.text(message, ended_with_eos)
        images = message.get("images") or []
        if not images:
            return self.tokenizer(text, add_special_tokens=False).input_ids, None
        from relax_models.processors.processor import build_multimodal_inputs

        return build_multimodal_inputs(self.processor, text, images=images)

    @property
    def processor(self):
        if self._processor is None:
            if self.model_path is None:
                raise RelaxUserError("an environment returned images but the model has no processor")
            from relax_models.processors.processor import load_processor

            self._processor = load_processor(self.model_path)
        return self._processor


def merge_multimodal(
    context: dict[str, torch.Tensor] | None, added: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor] | None:
    """The multimodal inputs of a context after a turn added media: items in order of appearance.

    A new dict (the prompt's dict is shared by the samples of a group and must not change).
    """
    if not added:
        return context
    if not context:
        return dict(added)
    merged = dict(context)
    for key, value in added.items():
        if key in merged and key in _CONCAT_KEYS:
            merged[key] = torch.cat([merged[key], value], dim=0)
        elif key in merged:
            raise ValueError(f"cannot append multimodal input {key!r} across turns")
        else:
            merged[key] = value
    return merged
