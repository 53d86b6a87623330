"""``cluster=in_process``: the same experiment with every role in the launcher's process and no Ray.

The roles, mode and run loop are the ones a Ray run uses, so for one seed the in-process run must give the
Ray run's per-step rewards exactly, resume from its own checkpoint step for step, and start no Ray at all.
``mode=async`` runs in one process too (each role on threads of its own, the in-memory bus); at
``mode.max_staleness=0`` it must take the colocate run's steps.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import launching
import pytest

# a short default experiment: warm-start, 8 RL steps, evaluations and a checkpoint half-way
SHORT = [
    "logger=jsonl",
    "trainer.sft_warmup_steps=10",
    "trainer.total_steps=8",
    "trainer.eval_every=4",
    "trainer.save_every=4",
    "trainer.export_final_model=false",
]
# what the GPU machine of scripts/gpu_check.sh lacks (issue 41): cluster=in_process must run without them
NOT_ON_GPU_MACHINE = ("ray", "mlflow", "vllm", "sglang", "megatron", "fastapi", "uvicorn", "math_verify")
# `python -m relax_launch` with those packages not installed, as importlib sees it (no finder finds them)
WITHOUT = textwrap.dedent(
    f"""
    import runpy, sys

    class Without:
        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {NOT_ON_GPU_MACHINE!r}:
                return None
            return self.finder.find_spec(name, path, target)

        def __getattr__(self, attr):
            return getattr(self.finder, attr)

    sys.meta_path[:] = [Without(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
    runpy.run_module("relax_launch", run_name="__main__", alter_sys=True)
    """
)


def launch(
    out: Path, *overrides: str, ray_tmp: Path | None = None, bare: bool = False
) -> subprocess.CompletedProcess:
    """``bare``: as on the GPU machine, without the packages of NOT_ON_GPU_MACHINE."""
    # RAY_TMPDIR: where Ray would put its session folder if anything started it
    env = {"RAY_TMPDIR": str(ray_tmp)} if ray_tmp is not None else {}
    command = [sys.executable, "-c", WITHOUT] if bare else launching.RELAX_LAUNCH
    result = launching.launch(out, *SHORT, *overrides, env=env, timeout=1200, command=command)
    assert "Traceback" not in result.stdout + result.stderr
    return result


def rewards(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("in_process")
    ray_tmp = tmp / "ray_tmp"
    ray_tmp.mkdir()
    out = {k: tmp / k for k in ("in_process", "ray", "resumed", "async")}
    with ThreadPoolExecutor(1) as beside:  # the Ray run beside the in-process ones: they use one core
        on_ray = beside.submit(launch, out["ray"], "cluster=local")
        logs = {"in_process": launch(out["in_process"], "cluster=in_process", ray_tmp=ray_tmp, bare=True)}
        checkpoint = out["in_process"] / "checkpoints" / "step_000004"
        logs["resumed"] = launch(  # its engine also frees its KV cache while the trainer steps
            out["resumed"],
            "cluster=in_process",
            f"trainer.resume={checkpoint}",
            "trainer.export_final_model=true",
            "rollout.release_memory_during_train=true",
        )
        logs["async"] = launch(
            out["async"],
            "cluster=in_process",
            "mode=async",
            "mode.databus=memory",
            "mode.max_staleness=0",
            ray_tmp=ray_tmp,
            bare=True,
        )
        logs["ray"] = on_ray.result()
    return {"dirs": out, "logs": logs, "ray_tmp": ray_tmp}


@pytest.mark.slow
def test_in_process_run_gives_the_ray_runs_rewards_step_for_step(runs) -> None:
    in_process, on_ray = rewards(runs["dirs"]["in_process"]), rewards(runs["dirs"]["ray"])
    assert sorted(in_process) == list(range(1, 9))
    assert in_process == on_ray
    summaries = [json.loads((runs["dirs"][k] / "summary.json").read_text()) for k in ("in_process", "ray")]
    for key in ("eval_accuracy_untrained", "eval_accuracy_start", "eval_accuracy_final"):
        assert summaries[0][key] == summaries[1][key], key


@pytest.mark.slow
def test_in_process_run_starts_no_ray_and_hands_weights_over_in_memory(runs) -> None:
    log = runs["logs"]["in_process"].stdout + runs["logs"]["in_process"].stderr
    assert "no Ray: every role runs in this process" in log
    assert "weight transfer: in_process" in log
    assert "Started a local Ray instance" not in log
    assert list(runs["ray_tmp"].iterdir()) == []  # no Ray session folder was created
    ray_log = runs["logs"]["ray"].stdout + runs["logs"]["ray"].stderr
    assert "Ray up:" in ray_log  # the comparison run really ran on Ray


@pytest.mark.slow
def test_in_process_async_run_at_staleness_zero_takes_the_colocate_steps(runs) -> None:
    """Rollout, Actor and Advantages on threads of one process, samples through the in-memory bus, weights
    handed over in memory; Ray and the other NOT_ON_GPU_MACHINE packages hidden, as for the colocate run."""
    log = runs["logs"]["async"].stdout + runs["logs"]["async"].stderr
    assert "async roles up: rolloutx1, actorx1, advantagesx1 | databus=memory" in log
    assert "weight transfer: in_process" in log and "No module named" not in log
    assert rewards(runs["dirs"]["async"]) == rewards(runs["dirs"]["in_process"])
    rows = [json.loads(line) for line in (runs["dirs"]["async"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness/max"] for r in rows if "reward/mean" in r] == [0.0] * 8
    assert list(runs["ray_tmp"].iterdir()) == []


@pytest.mark.slow
def test_in_process_run_resumes_from_its_checkpoint_step_for_step(runs) -> None:
    """Also with rollout.release_memory_during_train, which changes no sample."""
    straight, resumed = rewards(runs["dirs"]["in_process"]), rewards(runs["dirs"]["resumed"])
    assert {s: resumed[s] for s in range(5, 9)} == {s: straight[s] for s in range(5, 9)}
    rows = [json.loads(line) for line in (runs["dirs"]["resumed"] / "metrics.jsonl").read_text().splitlines()]
    released = [r["step"] for r in rows if "time/release_memory_s" in r and "time/resume_memory_s" in r]
    assert released == list(range(5, 9))
    summary = json.loads((runs["dirs"]["resumed"] / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["resumed_from"].endswith("step_000004")


@pytest.mark.slow
@pytest.mark.gpu_twin
def test_in_process_run_needs_no_ray_mlflow_or_engine_servers(runs) -> None:
    """The GPU check (scripts/gpu_check.sh) runs cluster=in_process where only torch and transformers are
    installed: the in-process run above had Ray, MLflow, vLLM, SGLang and megatron-core hidden."""
    log = runs["logs"]["in_process"].stdout + runs["logs"]["in_process"].stderr
    assert runs["logs"]["in_process"].args[1:3] == ["-c", WITHOUT]
    assert "No module named" not in log
    summary = json.loads((runs["dirs"]["in_process"] / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 8


EVAL = [sys.executable, "-m", "relax_launch.eval"]


def eval_accuracy(run: Path, step: int) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r["eval/accuracy"] for r in rows if r["step"] == step and "eval/accuracy" in r)


@pytest.mark.slow
def test_eval_only_scores_a_checkpoint_and_a_final_model_as_the_run_did(runs, tmp_path: Path) -> None:
    """``python -m relax_launch.eval`` on the in-process run's step-4 checkpoint and on the resumed run's
    final_model: the greedy accuracy those runs logged at that step, plus a sampled pass@2 per set."""
    dirs = runs["dirs"]
    models = {
        4: (dirs["in_process"], dirs["in_process"] / "checkpoints" / "step_000004"),
        8: (dirs["resumed"], dirs["resumed"] / "final_model"),
    }

    def evaluate(step: int, model: Path) -> tuple[Path, subprocess.CompletedProcess]:
        out = tmp_path / f"eval_{step}"
        overrides = [
            "cluster=in_process",
            "logger=jsonl",
            "eval.sets.heldout.n_samples=2",
            "eval.sets.heldout.k=[2]",
        ]
        result = launching.launch(
            out, f"model.path={model}", *overrides, cwd=tmp_path, timeout=600, check=False, command=EVAL
        )
        return out, result

    with ThreadPoolExecutor(2) as pool:  # each evaluation uses one core
        evaluations = {step: pool.submit(evaluate, step, model) for step, (_, model) in models.items()}
    for step, (run, model) in models.items():
        out, result = evaluations[step].result()
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        lines = [json.loads(line) for line in (out / "eval_metrics.jsonl").read_text().splitlines()]
        assert [row["set"] for row in lines] == ["heldout"] and 0.0 <= lines[0]["pass@2"] <= 1.0
        results = json.loads((out / "eval_results.json").read_text())
        assert results["metrics"]["eval/accuracy"] == eval_accuracy(run, step), step
        assert results["checkpoint"] == (str(model) if step == 4 else None)
