"""``genrm``: LLM-as-judge reward (a generative reward model answers "1" for correct, "0" otherwise).

The judge is either an object passed as ``judge`` (in the reward kwargs or ``metadata["judge"]``):
anything with a ``generate_text(prompt) -> str`` method or a plain callable ``prompt -> str``; or a
``url`` of a server speaking the SGLang-native ``/generate`` API (``{"text", "sampling_params"}`` ->
``{"text"}``), e.g. the router over the judge engines a run starts itself (``reward.judge``,
relax_core/rollout/judge.py). With a process pool the judge object must be picklable; a URL always is.

The verdict is ``verdict_pattern``'s first group (or whole match) in the reply after any ``</think>``;
``correct_verdict`` scores 1, any other verdict 0. A reply without a verdict scores 0 and counts as
``judge_parse_errors``; a judge that is down, refuses or is slow past ``timeout_s`` scores 0 and counts as
``judge_errors`` (metrics ``reward/judge_parse_errors``, ``reward/judge_errors``: shares of the samples).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from relax_rewards._text import strip_think
from relax_rewards.registry import register

log = logging.getLogger("relax_rewards.genrm")

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question against a reference answer.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Model answer:\n{response}\n\n"
    "Does the model answer agree with the reference answer? Ignore formatting and wording; judge only "
    "whether the final result is the same. Reply with the single digit 1 if it is correct and 0 if it "
    "is not, and nothing else."
)
DEFAULT_SAMPLING = {"temperature": 0.0, "max_new_tokens": 16}
# the whole reply (after any </think>) is one digit
DEFAULT_VERDICT_PATTERN = r"^\s*([01])\s*$"


def build_prompt(question: str, reference: str, response: str, template: str = DEFAULT_TEMPLATE) -> str:
    """Fill the judge template; ``{question}``, ``{reference}`` and ``{response}`` are its fields."""
    return template.format(question=question, reference=reference, response=response)


def _judge_callable(judge: Any) -> Callable[[str], str]:
    if hasattr(judge, "generate_text") and callable(judge.generate_text):
        return judge.generate_text
    if callable(judge):
        return judge
    raise TypeError(f"genrm judge must have generate_text(prompt) or be callable, got {type(judge).__name__}")


def sglang_generate(url: str, prompt: str, sampling_params: dict[str, Any], timeout_s: float) -> str:
    """One call to an SGLang-native ``/generate`` endpoint; returns the generated text."""
    import httpx

    endpoint = url.rstrip("/")
    if not endpoint.endswith("/generate"):
        endpoint += "/generate"
    resp = httpx.post(endpoint, json={"text": prompt, "sampling_params": sampling_params}, timeout=timeout_s)
    if resp.status_code != 200:
        raise RuntimeError(f"genrm judge at {endpoint} answered HTTP {resp.status_code}: {resp.text[:200]}")
    body = resp.json()
    if isinstance(body, list):  # batched form of the same API
        body = body[0] if body else {}
    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
        raise RuntimeError(f"genrm judge at {endpoint} replied without a 'text' string: {str(body)[:200]}")
    return body["text"]


def parse_verdict(reply: str, pattern: str = DEFAULT_VERDICT_PATTERN) -> str | None:
    """The verdict in ``reply`` (after any ``</think>``): ``pattern``'s first group, or its whole match when
    it has none; None when the reply has no verdict."""
    match = re.search(pattern, strip_think(reply))
    if match is None:
        return None
    return (match.group(1) if match.re.groups else match.group(0)).strip()


def check_genrm(kwargs: dict[str, Any]) -> None:
    """A ``verdict_pattern`` that is not a regular expression stops the launch, not every sample."""
    try:
        re.compile(kwargs.get("verdict_pattern", DEFAULT_VERDICT_PATTERN))
    except (re.error, TypeError) as err:
        raise ValueError(f"reward.kwargs.verdict_pattern is not a regular expression: {err}") from None


@register("genrm", key="score", needs_label=True, needs_one_of=("url", "judge"), check=check_genrm)
def genrm_reward(
    response: str,
    label: Any,
    metadata: dict[str, Any] | None = None,
    *,
    judge: Any = None,
    url: str | None = None,
    template: str = DEFAULT_TEMPLATE,
    sampling_params: dict[str, Any] | None = None,
    timeout_s: float = 8.0,
    verdict_pattern: str = DEFAULT_VERDICT_PATTERN,
    correct_verdict: str = "1",
) -> dict[str, float]:
    """``score`` 1.0 iff the judge's verdict on a prompt built from the question (``metadata["question"]``
    or ``metadata["prompt"]``), the reference answer (``label``) and the model's final answer is
    ``correct_verdict``; ``judge_parse_errors`` / ``judge_errors`` count a reply without a verdict and a
    judge that could not be reached in ``timeout_s`` (keep it below ``reward.timeout_s``)."""
    md = metadata or {}
    judge = judge if judge is not None else md.get("judge")
    url = url or md.get("judge_url")
    if judge is None and not url:
        raise ValueError(
            "genrm reward needs a judge: pass kwargs judge=<object|callable> or url='http://host:port'"
        )
    if label is None:
        raise ValueError("genrm reward needs a label (the reference answer), got None")
    question = str(md.get("question") or md.get("prompt") or "")
    prompt = build_prompt(question, str(label), strip_think(response).strip(), template)
    if judge is not None:
        reply = _judge_callable(judge)(prompt)
    else:
        import httpx

        try:
            reply = sglang_generate(
                str(url), prompt, {**DEFAULT_SAMPLING, **(sampling_params or {})}, timeout_s
            )
        except (httpx.HTTPError, RuntimeError) as err:  # down, refusing or slow: a counted 0, not a failure
            log.warning("genrm judge at %s did not answer: %s", url, str(err).splitlines()[0][:200])
            return {"score": 0.0, "judge_parse_errors": 0.0, "judge_errors": 1.0}
    if not isinstance(reply, str):
        raise TypeError(f"genrm judge returned {type(reply).__name__}, expected str")
    verdict = parse_verdict(reply, verdict_pattern)
    return {
        "score": float(verdict == str(correct_verdict)),
        "judge_parse_errors": float(verdict is None),
        "judge_errors": 0.0,
    }
