"""Training an external agent program through the launcher: real Ray, the real OpenAI-compatible endpoint
over the run's rollout engines, the example program as real subprocesses talking HTTP.

Each launch builds the tiny model and starts Ray (~30-60 s on 2 cores), so the runs are marked slow; the
config rules and the warm-start layout are checked in-process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import launching
import pytest

from relax_core.agentic.programs import mask_runs
from relax_core.agentic.tasks import calc_chat_row, calc_tools_row
from relax_core.agentic.tools import assistant_text
from relax_core.agentic.validation import validate_agent_program
from relax_core.agentic.warmstart import demo_samples
from relax_core.config.schema import AgentProgramConfig, DataConfig, RelaxConfig
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord

AGENT = launching.REPO / "examples" / "agents" / "calc_agent.py"
TOOLS_AGENT = launching.REPO / "examples" / "agents" / "calc_tools_agent.py"
FAULTY = launching.REPO / "tests" / "agentic" / "faulty_agent.py"
# what agent_tools_calc's RL must add to greedy accuracy on held-out questions: half the smallest gain of 5
# runs measured before the run was deterministic (0.50 to 0.81). The sampled train reward is too noisy over 40
# steps to gate on. Some runs never learn the choice: the warm-started policy samples mul on a * question
# only 10-40% of the time at temperature 0.2, and where early steps push add up everywhere (GRPO rewards it
# on + questions) a * group of 8 turns all add, scores 0 and teaches nothing; greedy then answers add on
# every eval question (0.1875, the share of + questions) to the end (about 1 run of 4, 2026-11-30). The run
# is deterministic for a seed (the endpoint batches a round's calls in lockstep: RequestBatcher in
# relax_core/agentic/server.py), so the test trains once, on SEED, which learns: greedy accuracy 0.1875 ->
# 1.0, a gain of 0.81, with the same per-step rewards and losses run to run (2026-12-07, AVX-512 host). CPU
# matmuls round differently per instruction set, so another kind of host replays its own run of the seed.
ACCURACY_GAIN = 0.25
SEED = 1
SHORT = [
    "experiment=agent_program_calc",
    "trainer.eval_every=0",
    "rollout.batch_size=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.agent.num_workers=4",
    "data.num_eval=4",
]


def test_agent_config_errors_name_the_key():
    cfg = RelaxConfig()
    cfg.rollout.agent = AgentProgramConfig(command=["python", "agent.py"])
    validate_agent_program(cfg)
    for key, value, needle in [
        ("command", [], "rollout.agent.command"),
        ("num_workers", 0, "rollout.agent.num_workers"),
        ("episode_timeout_s", 0.0, "rollout.agent.episode_timeout_s"),
    ]:
        bad = RelaxConfig()
        bad.rollout.agent = AgentProgramConfig(**({"command": ["python", "agent.py"]} | {key: value}))
        with pytest.raises(RelaxUserError, match=needle):
            validate_agent_program(bad)
    cfg.rollout.env = {"_target_": "relax_core.agentic.envs.CalculatorEnv"}
    with pytest.raises(RelaxUserError, match="exclude each other"):
        validate_agent_program(cfg)


def test_warm_start_demo_is_laid_out_as_the_endpoint_records_a_session(tokenizer):
    import random

    row = calc_chat_row(random.Random(0), DataConfig(min_digits=2, max_digits=2))
    messages = [{"role": "user", "content": row["prompt"]}]
    record = PromptRecord(7, [1], row["prompt"], row["label"], row["metadata"], messages=messages)
    (sample,) = demo_samples([record], tokenizer)
    expr, label = row["prompt"], row["label"]
    assert tokenizer.decode(sample.prompt_ids) == f"{expr}\n"  # the program's first call, rendered
    assert mask_runs(tokenizer, sample.response_ids, sample.loss_mask) == [
        {"mask": 1, "text": f"calc({expr})<eos>"},
        {"mask": 0, "text": f"={label}\n"},  # the tool message, as test_server shows the endpoint adds it
        {"mask": 1, "text": f"{label}<eos>"},
    ]
    bare = PromptRecord(8, [1], "x", "1", {}, messages=messages)
    with pytest.raises(RelaxUserError, match="metadata.demo"):
        demo_samples([bare], tokenizer)


def test_function_calling_demos_teach_the_protocol_but_not_which_function_fits(tokenizer):
    import random

    rng, cfg = random.Random(0), DataConfig(min_digits=1, max_digits=1)
    rows = [calc_tools_row(rng, cfg) for _ in range(200)]
    pairs = set()
    for row in rows:
        a, operator, b = re.fullmatch(r"(\d)([+*])(\d)", row["prompt"]).groups()
        assert row["label"] == str(int(a) + int(b) if operator == "+" else int(a) * int(b))
        assert row["metadata"]["tool"] == {"+": "add", "*": "mul"}[operator]
        call = row["metadata"]["demo"][0]["tool_calls"][0]["function"]
        pairs.add((operator, call["name"]))
    assert pairs == {("+", "add"), ("+", "mul"), ("*", "add"), ("*", "mul")}
    row = rows[0]
    messages = [{"role": "user", "content": row["prompt"]}]
    record = PromptRecord(0, [1], row["prompt"], row["label"], row["metadata"], messages=messages)
    (sample,) = demo_samples([record], tokenizer)
    (call,) = row["metadata"]["demo"]
    assert mask_runs(tokenizer, sample.response_ids, sample.loss_mask) == [
        {"mask": 1, "text": assistant_text(call) + "<eos>"}
    ]


def launch(tmp_path: Path, program: Path, *overrides: str) -> subprocess.CompletedProcess:
    command = f"rollout.agent.command=[{sys.executable},{program}]"
    return launching.launch(
        tmp_path, "logger=jsonl", command, *SHORT, *overrides, cwd=tmp_path, timeout=600, check=False
    )


def metric_rows(tmp_path: Path) -> list[dict]:
    return [r for r in launching.read_metrics(tmp_path) if r.get("step", 0) >= 1 and "reward/mean" in r]


@pytest.mark.slow
def test_example_agent_program_trains_with_masked_trajectories(tmp_path):
    run = launch(
        tmp_path,
        AGENT,
        "trainer.total_steps=3",
        "rollout.agent.save_trajectories=true",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = launching.read_summary(tmp_path)
    rows = metric_rows(tmp_path)
    assert summary["status"] == "finished" and len(rows) == 3
    assert all(r["agent/failed_sessions"] == 0 and r["optimizer_steps"] == 1 for r in rows), rows
    assert all(0.0 <= r["reward/acc"] <= 1.0 and r["reward/turns"] >= 1 for r in rows)
    sessions = [json.loads(line) for line in (tmp_path / "agent_logs" / "trajectories.jsonl").open()]
    by_round: dict[int, list[dict]] = {}
    for s in sessions:
        by_round.setdefault(s["round"], []).append(s)
    # greedy evals play each of the 4 eval prompts once; a training step plays 4 prompts x 4 samples
    steps = [r for r in by_round.values() if len(r) == 16]
    assert len(steps) == 3 and all(len({s["group_id"] for s in r}) == 4 for r in steps)
    trained = [s for r in steps for s in r]
    assert all(s["status"] != "failed" for s in trained)
    multi_turn = [s for s in trained if s["turns"] >= 2]
    assert multi_turn, "after the warm-start some episodes call the calculator"
    for s in multi_turn:
        masks = [seg["mask"] for seg in s["segments"]]
        assert masks[:3] == [1, 0, 1], s  # model turn, the tool result the program sent, model turn
        first, tool = s["segments"][0]["text"], s["segments"][1]["text"]
        assert first.startswith("calc(") and first.endswith("<eos>"), s
        assert tool.startswith("=") and tool.endswith("\n"), s
    for s in trained:  # every model turn is trained, nothing else is
        assert all(seg["mask"] == 1 for seg in s["segments"][::2])


@pytest.mark.slow
def test_programs_that_crash_hang_or_never_report_fail_their_sessions_only(tmp_path):
    run = launch(
        tmp_path,
        FAULTY,
        "trainer.total_steps=2",
        "trainer.sft_warmup_steps=0",
        "rollout.agent.episode_timeout_s=5",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = metric_rows(tmp_path)
    assert len(rows) == 2
    # three of every four episodes fail; a well-behaved one can also fall with a program killed under it
    assert all(0.7 <= r["reward/agent_failed"] < 1.0 for r in rows), rows
    assert rows[-1]["agent/restarts"] >= 2 * 3
    out = run.stdout + run.stderr
    assert "FAILED: the program exited with code 3" in out
    assert "FAILED: no reward within rollout.agent.episode_timeout_s=5" in out


@pytest.mark.slow
def test_program_that_cannot_start_stops_the_run_naming_the_command(tmp_path):
    missing = tmp_path / "no_such_agent.py"
    run = launch(tmp_path, missing, "trainer.total_steps=1", "trainer.sft_warmup_steps=0")
    assert run.returncode == 2
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("error: rollout.agent.command") and str(missing) in error, error
    assert "before taking an episode" in error and "No such file" in error


@pytest.mark.slow
def test_function_calling_agent_learns_which_function_fits_under_rl(tmp_path):
    """examples/agents/calc_tools_agent.py, written with the openai SDK's function calling and reading every
    reply as a stream, trained by ``experiment=agent_tools_calc``. The warm-start's demonstrations call
    add or mul at random, so they teach the protocol but not the choice: RL has to raise the reward."""
    summary = _train_calc_tools(tmp_path)
    assert summary["eval_accuracy_final"] >= summary["eval_accuracy_start"] + ACCURACY_GAIN, summary


def _train_calc_tools(run_dir: Path) -> dict:
    """One ``experiment=agent_tools_calc`` run in ``run_dir``; its summary, after the checks every run passes."""
    launching.launch(
        run_dir,
        "logger=jsonl",
        "experiment=agent_tools_calc",
        f"seed={SEED}",
        f"rollout.agent.command=[{sys.executable},{TOOLS_AGENT}]",
        "+rollout.agent.env.RELAX_AGENT_STREAM='1'",
        "rollout.agent.save_trajectories=true",
        "trainer.eval_every=0",
        cwd=run_dir,
        timeout=1800,
    )
    summary = launching.read_summary(run_dir)
    rows = metric_rows(run_dir)
    assert all(r["agent/failed_sessions"] == 0 for r in rows), rows
    assert summary["eval_accuracy_untrained"] == 0.0, summary
    sessions = [json.loads(line) for line in (run_dir / "agent_logs" / "trajectories.jsonl").open()]
    solved = [s for s in sessions if s["reward"] == 1.0]
    assert solved
    for s in solved:  # one trained model turn holding the call (2*2 = 2+2: either function can be right)
        (segment,) = s["segments"]
        assert segment["mask"] == 1 and "<tool_call>" in segment["text"], s
    return summary
