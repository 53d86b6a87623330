"""Multi-turn episodes with the real tiny model and torch engine: token layout, masks, stop reasons,
environment failures and time limits, chat-template and image observations."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relax_core.agentic import MultiTurnRunner
from relax_core.agentic.env import EnvFailure, call_with_timeout
from relax_core.agentic.envs import CalculatorEnv, GuessingEnv, evaluate_expression
from relax_core.agentic.formatting import ObservationFormatter, merge_multimodal
from relax_core.agentic.warmstart import expert_samples
from relax_core.engines.base import SamplingParams
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord, SampleStatus, TrainBatch
from tests.agentic import envs_fixture
from tests.agentic.conftest import calc_prompts, rollout_cfg

FIX = "tests.agentic.envs_fixture"
CALC = "relax_core.agentic.envs.CalculatorEnv"


def spans(sample, tokenizer) -> list[tuple[int, str]]:
    """(mask, text) runs of a sample's response."""
    runs: list[tuple[int, list[int]]] = []
    for tok, m in zip(sample.response_ids, sample.loss_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tok)
        else:
            runs.append((m, [tok]))
    return [(m, tokenizer.decode(ids)) for m, ids in runs]


def test_expert_episode_layout_masks_observations(tokenizer):
    prompts = calc_prompts(tokenizer, 3)
    samples = expert_samples(prompts, rollout_cfg(CALC), tokenizer, seed=0)
    assert len(samples) == 3
    for p, s in zip(prompts, samples):
        expr, answer = p.metadata["expr"], p.label
        assert spans(s, tokenizer) == [
            (1, f"calc({expr})<eos>"),
            (0, f"={answer}\n"),
            (1, f"{answer}<eos>"),
        ]
        assert (s.reward, s.num_turns, s.stop_reason, s.status) == (1.0, 2, "done", SampleStatus.COMPLETED)
        assert s.reward_extras["tool_called"] == 1.0 and s.reward_extras["acc"] == 1.0


def test_engine_episodes_keep_logprobs_on_model_tokens_only(tokenizer, engine):
    cfg = rollout_cfg(f"{FIX}.EchoEnv", max_turns=3, max_new_tokens=6, max_context_len=200)
    runner = MultiTurnRunner(cfg, tokenizer, seed=0)
    prompts = calc_prompts(tokenizer, 4)
    samples = runner.generate(engine, prompts, SamplingParams(max_new_tokens=6, n=3))
    assert len(samples) == 12
    assert [s.group_id for s in samples] == [p.index for p in prompts for _ in range(3)]
    for s in samples:
        assert len(s.response_ids) == len(s.loss_mask) == len(s.rollout_logprobs)
        assert s.num_turns == 3 and s.stop_reason == "max_turns" and s.status == SampleStatus.TRUNCATED
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        lp = torch.tensor(s.rollout_logprobs)
        assert (lp[mask] < 0).all(), "sampled tokens carry their (negative) log-probs"
        assert (lp[~mask] == 0).all(), "observation tokens carry no log-prob"
        # two observations "ok\n" between three model turns, none after the last turn; a turn cut at the
        # token budget is closed by an EOS on the observation's (masked) side
        runs = spans(s, tokenizer)
        assert [m for m, _ in runs] == [1, 0, 1, 0, 1]
        for (_, turn), (_, obs) in zip(runs[0::2], runs[1::2]):
            assert obs == ("ok\n" if turn.endswith("<eos>") else "<eos>ok\n")
        assert s.reward_extras["turns"] == 3.0
    # the batch the trainer builds keeps the mask aligned with the tokens
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        assert batch.loss_mask[i, :n].tolist() == [float(m) for m in s.loss_mask]
        assert batch.loss_mask[i, n:].sum() == 0


def test_context_budget_ends_episode(tokenizer, engine):
    cfg = rollout_cfg(f"{FIX}.EchoEnv", max_turns=50, max_new_tokens=8, max_context_len=30)
    samples = MultiTurnRunner(cfg, tokenizer).generate(
        engine, calc_prompts(tokenizer, 2), SamplingParams(max_new_tokens=8, n=2)
    )
    for s in samples:
        assert s.stop_reason == "context" and s.status == SampleStatus.TRUNCATED
        assert len(s.prompt_ids) + len(s.response_ids) <= 30
        assert s.loss_mask[-1] == 1, "an episode never ends on an observation it cannot answer"


def test_reward_function_scores_when_env_gives_none(tokenizer, engine):
    cfg = rollout_cfg(f"{FIX}.NoRewardEnv")
    scored = []

    def score(samples):
        scored.extend(samples)
        for s in samples:
            s.reward, s.reward_extras = 0.25, {"from_fn": 1.0}

    samples = MultiTurnRunner(cfg, tokenizer).generate(
        engine, calc_prompts(tokenizer, 2), SamplingParams(max_new_tokens=4, n=2), score
    )
    assert len(scored) == 4 and all(s.reward == 0.25 for s in samples)
    assert all(s.reward_extras["from_fn"] == 1.0 and s.reward_extras["seen"] == 1.0 for s in samples)


def flaky_prompts(tokenizer, modes: list[str]) -> list[PromptRecord]:
    return [
        PromptRecord(i, tokenizer("12+34").input_ids, "12+34", "46", {"mode": m}) for i, m in enumerate(modes)
    ]


@pytest.mark.parametrize("policy", ["mask", "keep"])
def test_env_that_raises_or_hangs_fails_only_its_sample(tokenizer, engine, policy):
    envs_fixture.RELEASE, envs_fixture.HUNG_STEP_RETURNED = threading.Event(), threading.Event()
    cfg = rollout_cfg(f"{FIX}.FlakyEnv", env_step_timeout_s=1.0, failed_sample_policy=policy)
    modes = ["ok", "raise", "hang", "raise_reset", "async"]
    try:
        samples = MultiTurnRunner(cfg, tokenizer).generate(
            engine, flaky_prompts(tokenizer, modes), SamplingParams(max_new_tokens=4, n=1)
        )
        # the hung step is released only below: a hung environment costs one step limit, not the run
        assert not envs_fixture.HUNG_STEP_RETURNED.is_set(), "the episodes waited for the hung step"
    finally:
        envs_fixture.RELEASE.set()
    by_mode = dict(zip(modes, samples))
    for mode in ("ok", "async"):
        s = by_mode[mode]
        assert (s.status, s.stop_reason, s.reward, s.num_turns) == (SampleStatus.COMPLETED, "done", 1.0, 2)
        assert s.reward_extras["env_failed"] == 0.0
    for mode, reason in (("raise", "env_error"), ("hang", "env_timeout"), ("raise_reset", "env_error")):
        s = by_mode[mode]
        assert s.status == SampleStatus.FAILED and s.stop_reason == reason and s.reward == 0.0
        assert s.reward_extras["env_failed"] == 1.0 and s.metadata["env_error"]
        expected = 0 if policy == "mask" else len(s.response_ids)
        assert sum(s.loss_mask) == expected
    assert "tool crashed" in by_mode["raise"].metadata["env_error"]
    assert by_mode["raise_reset"].response_ids == [], "a failed reset generates nothing"


def test_time_limit_is_per_step(tokenizer, engine):
    # three steps of 0.3 s each under a 0.5 s limit: fine, because the limit applies to each call
    cfg = rollout_cfg(f"{FIX}.SlowThenOkEnv", env_step_timeout_s=0.5)
    cfg.env["delay"] = 0.3
    samples = MultiTurnRunner(cfg, tokenizer).generate(
        engine, calc_prompts(tokenizer, 3), SamplingParams(max_new_tokens=4, n=1)
    )
    assert all(s.status == SampleStatus.COMPLETED and s.reward == 0.5 for s in samples)


def test_call_with_timeout_handles_sync_async_and_errors():
    async def coro(x):
        return x * 2

    assert call_with_timeout(lambda x: x + 1, 1, timeout=1.0) == 2
    assert call_with_timeout(coro, 4, timeout=1.0) == 8
    with pytest.raises(EnvFailure) as err:
        call_with_timeout(lambda: time.sleep(2), timeout=0.2)
    assert err.value.kind == "env_timeout"
    with pytest.raises(EnvFailure) as err:
        call_with_timeout(lambda: 1 / 0, timeout=1.0)
    assert err.value.kind == "env_error" and "ZeroDivisionError" in str(err.value)


def test_example_environments():
    env = CalculatorEnv(label="82", metadata={"expr": "37+45"})
    assert env.step("82") == (None, True, {"reward": 0.0, "acc": 0.0, "tool_called": 0.0})
    env = CalculatorEnv(label="82", metadata={"expr": "37+45"})
    assert env.step("calc(37+45)")[0] == "=82"
    assert env.step(" 82 ")[2]["reward"] == 1.0
    assert evaluate_expression("2+3*4-5") == 9
    with pytest.raises(ValueError):
        evaluate_expression("__import__('os')")
    game = GuessingEnv(label="11")
    moves = []
    for _ in range(4):
        guess = game.expert_action()
        obs, done, info = game.step(guess)
        moves.append((guess, obs))
        if done:
            break
    assert moves == [("8", "higher"), ("12", "lower"), ("10", "higher"), ("11", None)]
    assert info["reward"] == 1.0
    assert GuessingEnv(label="3").step("abc")[0] == "invalid"


def test_chat_template_observation_drops_the_models_own_eos(tokenizer):
    chat = tokenizer.__class__.from_pretrained(tokenizer.name_or_path, padding_side="left")
    chat.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    fmt = ObservationFormatter(chat)
    assert fmt.use_chat
    assert fmt.text({"role": "tool", "content": "=5"}) == "[tool]=5<eos>[assistant]"
    assert (
        fmt.text({"role": "tool", "content": "=5"}, ended_with_eos=False) == "<eos>[tool]=5<eos>[assistant]"
    )
    assert ObservationFormatter(tokenizer).text({"role": "user", "content": "=5"}) == "=5\n"


def test_validation_names_the_bad_key():
    from relax_core.agentic.validation import validate_agentic
    from relax_core.config.schema import RelaxConfig, TinyModelSpec

    cfg = RelaxConfig()
    cfg.model.tiny = TinyModelSpec()
    cfg.rollout.env = {"_target_": "no.such.Env"}
    with pytest.raises(RelaxUserError, match="rollout.env._target_"):
        validate_agentic(cfg)
    cfg.rollout.env = {"_target_": "relax_core.agentic.multiturn.Episode"}
    with pytest.raises(RelaxUserError, match="not a subclass"):
        validate_agentic(cfg)
    cfg.rollout.env = {"_target_": CALC}
    cfg.rollout.failed_sample_policy = "drop"
    with pytest.raises(RelaxUserError, match="rollout.failed_sample_policy"):
        validate_agentic(cfg)
    cfg.rollout.failed_sample_policy = "mask"
    cfg.rollout.max_context_len = 4096
    with pytest.raises(RelaxUserError, match="max_position_embeddings"):
        validate_agentic(cfg)


def test_image_observations_extend_the_visual_context(tmp_path):
    """Tiny Qwen3-VL twin: each observation's image adds placeholder tokens (mask 0) and its pixel tensors
    to the sample's multimodal inputs, after the prompt's own image."""
    import numpy as np
    from PIL import Image

    from relax_models.loader import load_tokenizer
    from relax_models.processors.processor import build_multimodal_inputs, load_processor
    from relax_models.tiny_multimodal import build_tiny_qwen3_vl

    path = str(build_tiny_qwen3_vl(tmp_path / "vl", seed=0))
    tok, proc = load_tokenizer(path), load_processor(path)
    picture = Image.fromarray(np.zeros((64, 64, 3), dtype="uint8"))
    prompt_ids, prompt_mm = build_multimodal_inputs(proc, "<image>what", images=[picture])
    prompt = PromptRecord(0, prompt_ids, "<image>what", None, {}, prompt_mm)
    cfg = rollout_cfg(f"{FIX}.ImageEnv", max_turns=3, max_context_len=256)
    eos = tok.eos_token_id

    def policy(episodes, cap):  # a fixed two-token answer each turn (the data path is under test)
        ids = tok("a", add_special_tokens=False).input_ids + [eos]
        return [(ids, [-0.5] * len(ids), "stop", 0) for _ in episodes]

    (s,) = MultiTurnRunner(cfg, tok, path).run([prompt], 1, policy)
    image_id = tok.convert_tokens_to_ids(tok.image_token)
    assert s.num_turns == 3 and s.stop_reason == "max_turns"
    grids = s.multimodal_inputs["image_grid_thw"]
    assert grids.shape[0] == 3, "prompt image + one per observation between turns"
    per_image = (grids.prod(-1) // proc.merge_size**2).tolist()
    tokens = torch.tensor(s.prompt_ids + s.response_ids)
    assert int((tokens == image_id).sum()) == sum(per_image)
    assert s.multimodal_inputs["pixel_values"].shape[0] == int(grids.prod(-1).sum())
    response = torch.tensor(s.response_ids)
    assert torch.tensor(s.loss_mask, dtype=torch.bool)[response == image_id].any().item() is False
    assert prompt.multimodal_inputs["image_grid_thw"].shape[0] == 1, "the shared prompt dict is untouched"
    assert merge_multimodal(None, None) is None


def test_custom_example_environment_with_reset_observation(tokenizer):
    """examples/agentic/word_env.py: the reset observation follows the prompt (masked), one letter per turn."""
    prompt = PromptRecord(0, tokenizer("word").input_ids, "word", "cat", {})
    cfg = rollout_cfg("examples.agentic.word_env.ReverseSpellEnv", max_turns=6)
    (s,) = expert_samples([prompt], cfg, tokenizer, seed=0)
    assert spans(s, tokenizer) == [
        (0, "spell cat backwards\n"),
        (1, "t<eos>"),
        (0, "next\n"),
        (1, "a<eos>"),
        (0, "next\n"),
        (1, "c<eos>"),
    ]
    assert s.num_turns == 3 and s.stop_reason == "done" and s.reward == pytest.approx(1.0)
