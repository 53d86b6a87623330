"""The run loop: data and model in, roles started by the mode, RL steps, evaluation, checkpoints, out.

Read top to bottom this is a whole run: load the model folder and prompts -> the mode starts every role
(relax_core/modes/) -> evaluate -> supervised warm-start -> for each step the mode yields its metrics ->
log, evaluate, checkpoint -> summary. Health (in-place restarts, global restarts from a checkpoint) and
checkpointing get the role groups explicitly; neither reaches into the mode.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core.algorithms.spec import requirements
from relax_core.data.multimodal import MediaPrompts
from relax_core.data.prompts import PromptStream, dataset_paths, load_prompts
from relax_core.evaluation.evaluator import Evaluator
from relax_core.modes import build_mode
from relax_core.modes.base import ERROR_EXAMPLE, RunContext, resolve_threads
from relax_core.resilience.checkpoint import (
    STOP_REQUEST,
    CheckpointManager,
    check_shared_dir,
    checkpoint_root,
    refuse_nonfinite_policy,
    resolve_resume,
    restore_run,
    rewind_sink,
    save_run,
)
from relax_core.resilience.health import GlobalRestartNeeded, HealthManager, TrainingGuard
from relax_core.runtime import handles
from relax_core.samples import Sample, TrainBatch
from relax_core.telemetry.metrics import MetricsSink, check_tracking_server, format_step_line
from relax_models.loader import load_tokenizer, resolve_model_path

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig

log = logging.getLogger("relax")


class RunLoop:
    def __init__(self, cfg: RelaxConfig, resolved: dict[str, Any]) -> None:
        """Loads the model folder and the datasets: user errors surface here, before Ray starts."""
        resolve_threads(cfg)
        if cfg.logger.name == "mlflow":
            check_tracking_server(cfg.logger.tracking_uri)
        self.cfg = cfg
        self.resolved = resolved
        model_path = resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
        self.tokenizer = load_tokenizer(model_path)
        if cfg.rollout.env is not None or cfg.rollout.agent is not None:
            import relax_core.agentic  # noqa: F401  (registers the agentic synthetic tasks)
        train_path, eval_path = dataset_paths(cfg.data, cfg.output_dir, cfg.seed)
        # multimodal runs (modality.keys): the processor reads media columns; None for text
        self.media = MediaPrompts.from_config(cfg.modality, model_path)
        train, self.skipped_rows = load_prompts(train_path, cfg.data, self.tokenizer, self.media, lazy=True)
        self.evaluator = Evaluator(cfg, self.tokenizer, self.media, eval_path)
        self.stream = PromptStream(train, cfg.seed, cfg.data.shuffle)
        teacher_path = None
        if cfg.algorithm.teacher is not None:
            from relax_core.roles.teacher import check_tokenizer_match, resolve_teacher_path

            teacher_path = resolve_teacher_path(cfg)  # trains the default teacher once if missing
            check_tokenizer_match(model_path, teacher_path)
        self.ctx = RunContext(cfg, model_path, self.tokenizer, self.stream, requirements(cfg), teacher_path)
        self.mode = build_mode(self.ctx)
        self.sink: MetricsSink | None = None
        self.health: HealthManager | None = None

    # ---------------------------------------------------------------- phases around the RL steps
    def evaluate(self, step: int = 0) -> dict[str, float]:
        """The eval sets due after RL ``step`` (0: before RL) on the mode's engines (relax_core/evaluation/evaluator.py)."""
        return self.evaluator.run(self.mode.generate, step)

    def evaluate_only(self, checkpoint: str | None = None) -> dict[str, Any]:
        """Score the model on every eval set (sampled passes included) without training, after loading a
        run's ``checkpoint`` when given (relax_launch/eval.py). Writes one JSON line per set to
        ``eval_metrics.jsonl`` and everything to ``eval_results.json`` in the run dir; returns the latter."""
        self.evaluator.sampled_ok = self.cfg.rollout.agent is None  # no training draws to keep apart
        try:
            self.mode.start()
            if checkpoint is not None:
                restore_run(self.mode.roles, checkpoint, self.mode.publish)
            metrics = self.evaluate(self.cfg.trainer.total_steps)
        finally:
            self.mode.stop()
            self.evaluator.close()
        out = Path(self.cfg.output_dir)
        sets = self.evaluator.summary(metrics)
        with open(out / "eval_metrics.jsonl", "a") as lines:
            lines.writelines(json.dumps({"set": name, **m}) + "\n" for name, m in sets.items())
        results = {
            "status": "finished",
            "model": self.ctx.model_path,
            "checkpoint": checkpoint,
            "sets": sets,
            "metrics": metrics,
            "output_dir": self.cfg.output_dir,
        }
        (out / "eval_results.json").write_text(json.dumps(results, indent=2))
        return results

    def warm_start(self) -> None:
        """Supervised warm-start on (prompt, label) pairs: teaches the output format before RL. The
        Reference and the Critic's trunk then start from the warm-started policy, version 0."""
        t, roles = self.cfg.trainer, self.mode.roles
        eos = self.tokenizer.eos_token_id
        for i in range(t.sft_warmup_steps):
            prompts = self.stream.next_batch(t.sft_batch_size)
            samples = []
            if self.cfg.rollout.env is not None:  # agentic: expert episodes against the environment
                from relax_core.agentic.warmstart import expert_samples

                samples = expert_samples(prompts, self.cfg.rollout, self.tokenizer, seed=self.cfg.seed + i)
                prompts = []
            elif self.cfg.rollout.agent is not None:  # agent program: the rows' demonstration conversations
                from relax_core.agentic.warmstart import demo_samples

                samples, prompts = demo_samples(prompts, self.tokenizer), []
            if self.media is not None:  # pixel/audio tensors of the drawn prompts
                prompts = self.media.materialize(prompts)
            for p in prompts:
                target = self.tokenizer(str(p.label), add_special_tokens=False).input_ids + [eos]
                samples.append(
                    Sample(
                        p.index,
                        0,
                        p.prompt_ids,
                        target,
                        [0.0] * len(target),
                        [1] * len(target),
                        multimodal_inputs=p.multimodal_inputs,
                    )
                )
            batch = TrainBatch.from_samples(samples, self.tokenizer.pad_token_id)
            m = roles.actor.call_collective("sft_step", batch)
            if i == 0 or (i + 1) % 10 == 0 or i + 1 == t.sft_warmup_steps:
                log.info("warm-start %d/%d | nll %.4f", i + 1, t.sft_warmup_steps, m["loss"])
        roles.actor.call_collective("end_warm_start")
        if roles.reference is not None or roles.critic is not None:
            weights = handles.put(roles.actor.call_collective("state_dict"))
            refs = roles.reference.call("load_weights", weights, 0) if roles.reference is not None else []
            refs += roles.critic.call("load_trunk", weights) if roles.critic is not None else []
            handles.get(refs)
            self.keep_reference_copy()
        self.mode.publish(0)

    def keep_reference_copy(self) -> None:
        """The Reference's weights (warm-started or restored) on disk, for a Reference restarted in place."""
        if self.mode.roles.reference is not None:
            path = f"{self.cfg.output_dir}/reference_weights"
            handles.get(self.mode.roles.reference.call("save_checkpoint", path))
            self.mode.reference_copy = path

    def start_control_plane(self):
        """HTTP control plane (health, metrics, elastic rollout scaling) when ``control_plane.enabled``."""
        if not self.cfg.control_plane.enabled:
            return None
        from relax_core.rollout.control_plane import ControlPlane
        from relax_core.rollout.pool import RolloutPool

        def pool() -> RolloutPool | None:
            rollout = self.mode.roles.rollout
            return rollout if isinstance(rollout, RolloutPool) else None

        def latest() -> dict[str, Any]:
            return dict(self.sink.history[-1]) if self.sink is not None and self.sink.history else {}

        return ControlPlane(self.cfg, pool, latest)

    # ---------------------------------------------------------------- checkpoints
    def save(self, step: int, evals: dict[str, Any]) -> None:
        driver = {
            "stream": self.mode.stream_state(),
            "history": list(self.sink.history),
            "health": self.health.state_dict(),
            "extra": evals,
            "mode": self.mode.state_dict(),
        }
        save_run(self.mode.roles, self.checkpoints, step, driver)

    def restore(self, path) -> dict[str, Any]:
        """Load checkpoint ``path`` into the running roles; returns its driver state."""
        driver = restore_run(self.mode.roles, path, self.mode.publish)
        self.keep_reference_copy()
        self.stream.load_state_dict(driver["stream"])
        self.mode.load_state_dict(driver.get("mode", {}))
        if driver.get("health"):
            self.health.load_state_dict(driver["health"])
        rewind_sink(self.sink, int(driver["step"]), driver["history"])
        return driver

    def restart_everything(self, reason: str) -> int:
        """A role whose state lives only in its process died: restart every role from the newest
        checkpoint; returns the step it holds."""
        ckpt = self.health.global_restart(reason, self.checkpoints.root)
        self.health.stop()
        self.mode.stop()
        self.health.start_when_room(self.mode.start, self.mode.stop)  # a lost node may have to come back
        driver = self.restore(ckpt)
        self.health.start()
        return int(driver["step"])

    # ---------------------------------------------------------------- the run
    def run(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.trainer
        # checkpoint/resume (relax_core/resilience/checkpoint.py)
        resume_from = resolve_resume(t.resume, cfg.output_dir)
        if cfg.cluster.name != "in_process":  # ranks on several nodes all write and read the run dir
            check_shared_dir(cfg.output_dir, "hydra.run.dir")
        self.checkpoints = CheckpointManager(checkpoint_root(cfg.output_dir), t.save_every, t.keep_last)
        self.sink = MetricsSink(cfg, self.resolved)
        summary: dict[str, Any] = {"status": "failed"}
        control_plane = None
        try:  # from here on, a failure still marks the MLflow run failed and tears the roles down
            self.mode.start()
            self.health = HealthManager(
                lambda: self.mode.roles.all(),
                t,
                cfg.cluster.max_global_restarts,
                cfg.output_dir,
                self.mode.replaced,
            )
            self.mode.health = self.health
            self.guard = TrainingGuard(t)
            self.mode.checkpoint_due = lambda s: (
                self.checkpoints.due(s, t.total_steps) or STOP_REQUEST.is_set()
            )
            control_plane = self.start_control_plane()
            step = 1
            if resume_from is not None:
                driver = self.restore(resume_from)
                init_eval, start_eval = driver["extra"]["init_eval"], driver["extra"]["start_eval"]
                step = driver["step"] + 1
            else:
                init_eval = self.evaluate()
                if t.sft_warmup_steps:
                    self.warm_start()
                start_eval = self.evaluate() if t.sft_warmup_steps else init_eval
                self.sink.log(0, {f"{k}_init": v for k, v in init_eval.items()} | start_eval)
                log.info(
                    "eval before training: accuracy %.3f (untrained) -> %.3f (after warm-start)",
                    init_eval.get("eval/accuracy", float("nan")),
                    start_eval.get("eval/accuracy", float("nan")),
                )
            evals = {"init_eval": init_eval, "start_eval": start_eval}
            if t.save_every and resume_from is None:  # step 0: what a global restart falls back to
                self.save(0, evals)
            self.health.start()
            while True:
                try:
                    summary = self.train(step, evals) or self.summarize(init_eval, start_eval, resume_from)
                    return summary
                except GlobalRestartNeeded as why:
                    # a dead Actor, in a step or in the final export: everything restarts from a checkpoint
                    step = self.restart_everything(str(why)) + 1
        finally:
            if self.health is not None:
                self.health.stop()
            if control_plane is not None:
                control_plane.stop()
            self.mode.stop()
            self.evaluator.close()
            self.sink.finish(
                {k: v for k, v in summary.items() if v is not None},
                "FINISHED" if summary["status"] == "finished" else "FAILED",
            )

    def train(self, first: int, evals: dict[str, Any]) -> dict[str, Any] | None:
        """RL steps ``first``..``trainer.total_steps``; the summary of a preempted run when a stop request
        cut them short (saved: the job requeues)."""
        for done, metrics in self.mode.steps(first, self.evaluate):
            self.after_step(done, metrics, evals)
            if STOP_REQUEST.is_set() and done < self.cfg.trainer.total_steps:
                return {"status": "preempted", "steps": done, "output_dir": self.cfg.output_dir}
        return None

    def after_step(self, step: int, metrics: dict[str, float], evals: dict[str, Any]) -> None:
        """Evaluate when due, log, checkpoint when due (or when a preemption asks for it)."""
        t = self.cfg.trainer
        metrics |= self.health.metrics()
        if self.mode.judge is not None:
            metrics |= self.mode.judge.metrics()
        example = metrics.pop(ERROR_EXAMPLE, None)
        if (
            t.eval_every
            and (step % t.eval_every == 0 or step == t.total_steps)
            and not any(k.startswith("eval/") for k in metrics)
            and self.evaluator.due(step)
        ):
            metrics |= self.health.guarded(lambda: self.evaluate(step))
        self.sink.log(step, metrics)
        log.info(format_step_line(step, t.total_steps, metrics))
        self.guard.check(step, metrics, example)  # a run training on nothing valid stops, before saving it
        if self.checkpoints.due(step, t.total_steps) or STOP_REQUEST.is_set():
            self.health.guarded(lambda: self.save(step, evals))

    def summarize(self, init_eval: dict, start_eval: dict, resume_from) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.trainer
        rewards = [r["reward/mean"] for r in self.sink.history if "reward/mean" in r]
        if t.export_final_model:
            final_model = f"{cfg.output_dir}/final_model"

            def export() -> None:
                refuse_nonfinite_policy(self.mode.roles, final_model)
                self.mode.roles.actor.call_collective("export_hf", final_model)

            self.health.guarded(export)
        final_eval = self.sink.history[-1] if self.sink.history else {}
        if not any(k.startswith("eval/") for k in final_eval):
            final_eval = self.health.guarded(lambda: self.evaluate(t.total_steps))
        tenth = max(1, len(rewards) // 10)
        summary = {
            "status": "finished",
            "steps": len(rewards),
            "reward_first_10pct": sum(rewards[:tenth]) / tenth,
            "reward_last_10pct": sum(rewards[-tenth:]) / tenth,
            "eval_accuracy_untrained": init_eval.get("eval/accuracy"),
            "eval_accuracy_start": start_eval.get("eval/accuracy"),
            "eval_accuracy_final": final_eval.get("eval/accuracy"),
            # every set's metrics before RL and at the end (pass@k, maj@k, lengths ...)
            "eval_sets_start": self.evaluator.summary(start_eval),
            "eval_sets_final": self.evaluator.summary(final_eval),
            # a lazily read training set meets its malformed rows as batches draw them
            "skipped_rows": getattr(self.stream.records, "skipped", self.skipped_rows),
            "output_dir": cfg.output_dir,
        }
        summary["reward_gain"] = summary["reward_last_10pct"] - summary["reward_first_10pct"]
        summary |= {k.replace("health/", "health_"): v for k, v in self.health.metrics().items()}
        summary["resumed_from"] = str(resume_from) if resume_from is not None else None
        return summary
