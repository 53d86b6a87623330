"""What ``mode=async`` carries besides text on one torch Actor: multimodal prompts through the DataBus (one
copy of a prompt's media per write), megatron's streamed step, agent programs. One short launch per
combination; each asserts the run finished with contiguous steps and a property only that combination has.
Megatron's tensor-parallel ranks in async, against colocate's steps: tests/megatron/test_megatron_launch.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import launching
import pytest
import torch

from relax_core.algorithms.spec import requirements
from relax_core.databus import InMemoryDataBus, partition_name, sample_key
from relax_core.databus.records import FORWARD_FIELDS, SAMPLE_FIELDS, batch_from_rows, get_rows, sample_rows
from relax_core.databus.stages import BusStep
from relax_core.roles.actor import Actor
from relax_core.samples import Sample
from tests.core.conftest import compose_config
from tests.megatron.conftest import megatron_world  # noqa: F401  (fixture)

AGENT = Path(__file__).resolve().parents[2] / "examples" / "agents" / "calc_agent.py"
SMALL = [
    "mode=async",
    "trainer.total_steps=3",
    "trainer.eval_every=0",
    "rollout.num_threads=1",
    "trainer.num_threads=1",
    "logger=jsonl",
    "cluster.num_cpus=4",
]
# media: 3 steps of 4 prompts x 4 samples; the Reference (KL) scores the rows too, so both model roles
# rebuild the prompts' media from the bus
MEDIA = ["rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "trainer.sft_warmup_steps=2"]
MEDIA += ["data.num_train=64", "data.num_eval=8", "algorithm.kl_loss_coef=0.01"]
TEXT = ["rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "trainer.sft_warmup_steps=2"]
TEXT += ["data.num_train=64", "data.num_eval=8", "trainer.micro_batch_size=4"]
COMBINATIONS = {
    "vision": ["experiment=vision_colors_tiny_vl", *MEDIA],
    "audio_omni": ["experiment=audio_tones_tiny_omni", *MEDIA],
    # the program plays every episode through the endpoint over the async engines
    "agent_program": [
        "experiment=agent_program_calc",
        *TEXT,
        "data.num_eval=4",
        "rollout.agent.num_workers=4",
        "rollout.agent.save_trajectories=true",
        f"rollout.agent.command=[{sys.executable},{AGENT}]",
    ],
}


def launch(out: Path, overrides: list[str]) -> list[dict]:
    launching.launch(out, *SMALL, *overrides, env=launching.RAY_NO_AUTH, timeout=600)
    assert launching.read_summary(out)["status"] == "finished"
    steps = [r for r in launching.read_metrics(out) if r.get("step", 0) > 0 and "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    return steps


@pytest.mark.slow
@pytest.mark.parametrize("combination", list(COMBINATIONS))
def test_async_runs(tmp_path: Path, combination: str) -> None:
    steps = launch(tmp_path / "run", COMBINATIONS[combination])
    if combination == "agent_program":
        sessions = [
            json.loads(line) for line in (tmp_path / "run" / "agent_logs" / "trajectories.jsonl").open()
        ]
        rounds: dict[int, list[dict]] = {}
        for s in sessions:
            rounds.setdefault(s["round"], []).append(s)
        # greedy evaluations play the 4 eval prompts once each; each step 4 prompts x 4 episodes
        steps_played = [r for r in rounds.values() if len(r) == 16]
        assert len(steps_played) == 3 and all(s["status"] == "completed" for r in steps_played for s in r)
        assert all(row["agent/failed_sessions"] == 0 for row in steps)
    if combination in ("vision", "audio_omni"):
        # step 1 is trained and sampled on version 0: the Actor's log-probs equal the engine's, and the
        # Reference's the Actor's, only if both got each row's own image / audio from the bus
        assert steps[0]["off_policy/train_rollout_abs_diff"] < 1e-4, steps[0]
        assert steps[0]["kl"] < 1e-6, steps[0]


def _sample(i: int, inputs: dict | None) -> Sample:
    return Sample(
        i // 2, i % 2, [1, 2, 3], [4, 5], [-0.5, -0.25], [1, 1], reward=1.0, multimodal_inputs=inputs
    )


def test_bus_rows_carry_media_once_per_prompt() -> None:
    """Two prompts' media (shared by their 2 samples) and a text row: the bytes travel once per prompt, a
    row read without the row that holds them still gets them, and a batch's rows share one dict per prompt."""
    image = {"pixel_values": torch.randn(4, 6), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    audio = {
        "input_features": torch.randn(1, 8, 5),
        "feature_attention_mask": torch.ones(1, 5, dtype=torch.long),
    }
    samples = [_sample(0, image), _sample(1, image), _sample(2, audio), _sample(3, audio), _sample(4, None)]
    keys = [sample_key(p) for p in (6, 7, 2, 3, 9)]  # group slots, as Rollout writes them
    bus, part = InMemoryDataBus(), partition_name(1)
    _, fields = sample_rows(samples, 0, keys)
    assert [len(m) > 0 for m in fields["media"]] == [True, False, True, False, False]
    bus.put(part, keys, fields)
    need = SAMPLE_FIELDS + FORWARD_FIELDS
    assert bus.ready(part, need) == sorted(keys)
    wanted = [sample_key(p) for p in (3, 7, 9, 6)]  # 3 and 7 without the rows holding their media
    batch = batch_from_rows(get_rows(bus, part, wanted, need), pad_token_id=0)
    got = batch.multimodal_inputs
    assert got[0] is not None and torch.equal(got[0]["input_features"], audio["input_features"])
    assert got[1] is got[3] and torch.equal(got[1]["pixel_values"], image["pixel_values"])
    assert torch.equal(got[1]["image_grid_thw"], image["image_grid_thw"]) and got[2] is None


def test_megatron_actor_streamed_from_the_bus_takes_the_whole_batch_step(
    megatron_world,  # noqa: F811
    tmp_path: Path,
    tiny_model_dir: Path,
) -> None:
    """The megatron Actor streams a step's rows in micro-batches and scales its gradient buffers once the
    batch total is known: the same loss and gradient norm as one step on the whole batch (colocate's)."""
    cfg = compose_config(
        ["mode=async", "trainer=megatron", "rollout.batch_size=2", "rollout.n_samples_per_prompt=4"]
        + ["trainer.micro_batch_size=3", "trainer.num_threads=1"],
        tmp_path,
    )
    samples = [
        Sample(
            i // 4,
            i % 4,
            [5, 6, 7 + i % 3],
            [8 + i % 5, 9, 10][: 1 + i % 3],
            [-1.0, -1.2, -0.8][: 1 + i % 3],
            [1] * (1 + i % 3),
            reward=float(i % 2),
        )
        for i in range(8)
    ]
    keys, fields = sample_rows(samples, 0)
    fields["advantages"] = [torch.full((len(s.response_ids),), s.reward - 0.5) for s in samples]
    bus = InMemoryDataBus()
    bus.put(partition_name(1), keys, fields)
    actor = Actor(cfg, str(tiny_model_dir), bus=bus)
    start = {k: v.clone() for k, v in actor.backend.state_dict().items()}
    extras = list(requirements(cfg).train_fields)
    streamed = actor.train(1, BusStep(len(samples), SAMPLE_FIELDS + FORWARD_FIELDS + extras, extras))
    actor.backend.load_state_dict(start)
    whole = actor.train(1, batch_from_rows(fields, actor.pad, extras))
    for key in ("loss", "grad_norm", "entropy"):
        assert streamed[key] == pytest.approx(whole[key], rel=1e-5), key


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_media_for_http_engines_are_refused_up_front(engine: str, tmp_path: Path) -> None:
    """vLLM and SGLang are driven with token ids only: a multimodal run naming them stops before Ray, and a
    request with media (an external engine joining a multimodal run) fails instead of losing its media."""
    from relax_core.engines.base import GenerationRequest, SamplingParams
    from relax_core.engines.client import HttpEngine
    from relax_core.errors import RelaxUserError
    from relax_core.preflight.validation import validate

    cfg = compose_config(
        ["experiment=audio_tones_tiny_omni", f"rollout={engine}", "rollout.num_gpus=0"], tmp_path
    )
    with pytest.raises(RelaxUserError, match=f"rollout={engine} cannot take audio inputs yet"):
        validate(cfg)
    client = HttpEngine("http://127.0.0.1:9")  # nothing listens: refused before any request is sent
    request = GenerationRequest([1, 2], "p0", {"input_features": torch.zeros(1, 8, 5)})
    with pytest.raises(RelaxUserError, match="carries media"):
        client._one(request, SamplingParams(max_new_tokens=2))
