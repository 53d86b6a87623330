"""Where a run's numbers go: ``metrics.jsonl``, MLflow, TensorBoard, W&B, the terminal and a reward plot."""

from __future__ import annotations

import json
import logging
import math
import netrc
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from relax_core.errors import RelaxUserError, disk_full

if TYPE_CHECKING:
    from relax_core.config.schema import LoggerConfig, RelaxConfig

log = logging.getLogger("relax")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def format_step_line(step: int, total: int, m: dict[str, float]) -> str:
    parts = [f"step {step:>4}/{total}", f"reward {m['reward/mean']:.3f}±{m['reward/std']:.3f}"]
    if "eval/accuracy" in m:
        parts.append(f"eval acc {m['eval/accuracy']:.3f}")
    if m.get("actor_frozen"):  # PPO's critic warm-up: the policy waits, it has no loss or entropy
        parts.append("actor waits for the critic")
    else:
        parts += [f"loss {m['loss']:+.4f}", f"kl {m['kl']:.4f}", f"ent {m['entropy']:.3f}"]
    if "staleness/mean" in m:
        parts.append(f"stale {m['staleness/mean']:.1f}")
    parts += [f"{m['tokens_per_s']:.0f} tok/s", f"{m['step_time_s']:.2f}s"]
    return " | ".join(parts)


def check_tracking_server(uri: str | None, timeout_s: float = 5.0) -> None:
    """Fail at once when an http(s) ``logger.tracking_uri`` has no server behind it: MLflow's own client
    retries a refused connection for minutes before it says so."""
    if not uri or not uri.startswith(("http://", "https://")):
        return
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # a server answered (a proxy, an auth wall): MLflow reports whatever it has to say
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise RelaxUserError(
            f"logger.tracking_uri={uri!r}: no MLflow server answers ({reason}); start one "
            "(mlflow server --backend-store-uri sqlite:///mlflow.db) or drop the override to log into the run dir"
        ) from None


def mlflow_client(uri: str) -> Any:
    """An ``MlflowClient`` on ``uri``, logging synchronously, without the schema migrations' log lines."""
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def create_run(client, experiment_name: str, run_name: str | None, tags: dict[str, str]) -> str:
    """A new run in MLflow experiment ``experiment_name`` (created when missing); returns its id. Its tags
    are ``tags`` plus those MLflow's own ``start_run`` records (user, source script and type, git commit),
    which a run created through a client does not get by itself."""
    from mlflow.tracking.context.registry import resolve_tags

    experiment = client.get_experiment_by_name(experiment_name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
    return client.create_run(experiment_id, run_name=run_name, tags=resolve_tags(tags)).info.run_id


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file and a rename: a reader (or a full disk) never leaves
    a truncated file; a full disk is a one-line error naming ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        full = disk_full(err, path)
        if full is None:
            raise
        raise full from None


class MlflowRun:
    """This run's MLflow run, written through a client rather than MLflow's process-wide active run.

    Opening a fresh SQLite store (import, schema migrations, params) takes seconds, so it happens on a
    thread while the roles start; the first metrics wait for it. A store that cannot be opened fails the
    first ``log_metrics`` with MLflow's own error, and is left alone when the run finishes.
    """

    def __init__(self, uri: str, logger_cfg: LoggerConfig, params: dict[str, str], config_path: Path) -> None:
        self.uri = uri
        self._opening = ThreadPoolExecutor(max_workers=1, thread_name_prefix="relax-mlflow")
        self._opened = self._opening.submit(self._open, logger_cfg, params, config_path)

    def _open(self, logger_cfg: LoggerConfig, params: dict[str, str], config_path: Path) -> tuple[Any, str]:
        from mlflow.entities import Param

        client = mlflow_client(self.uri)
        parent = os.environ.get("RELAX_PARENT_RUN_ID")  # a sweep's point nests under the sweep's run
        tags = {"mlflow.parentRunId": parent} if parent else {}
        run_id = create_run(client, logger_cfg.experiment_name, logger_cfg.run_name, tags)
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            client.log_batch(run_id, params=items[i : i + 100])
        client.log_artifact(run_id, str(config_path))
        log.info("MLflow run %s at %s", run_id, self.uri)
        return client, run_id

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        client, run_id = self._opened.result()
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self, metrics: dict[str, float], artifacts: list[Path], status: str) -> None:
        self._opening.shutdown()
        if self._opened.exception() is not None:  # already raised by log_metrics; the run's own error stands
            return
        client, run_id = self._opened.result()
        self.log_metrics(metrics)
        for path in artifacts:
            client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, status)


def wandb_mode() -> str:
    """``WANDB_MODE`` when set; else ``online`` if the user has logged in (``WANDB_API_KEY``, or the netrc
    entry ``wandb login`` writes for the W&B host), ``offline`` otherwise: a run never stops at W&B's login
    prompt or waits on the network."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc(os.environ.get("NETRC") or None).authenticators(host or "")
    except (OSError, netrc.NetrcParseError):
        entry = None
    return "online" if entry else "offline"


class WandbRun:
    """This run's W&B run: the resolved config, per-step metrics, and at the end the summary, the reward
    plot and the eval tables. ``wandb`` is imported here only: runs without it never pay its import."""

    def __init__(self, logger_cfg: LoggerConfig, resolved: dict[str, Any], out: Path) -> None:
        import wandb

        mode = wandb_mode()
        self.run = wandb.init(
            project=logger_cfg.wandb_project,
            entity=logger_cfg.wandb_entity,
            group=logger_cfg.wandb_group or os.environ.get("RELAX_SWEEP_GROUP"),
            name=logger_cfg.run_name,
            config=resolved,
            dir=str(out),
            mode=mode,
            # Relax logs to the console itself; W&B's stdout capture would wrap it a second time
            settings=wandb.Settings(console="off", silent=True),
        )
        log.info("W&B run %s (%s) in %s", self.run.id, mode, self.run.dir)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict[str, Any], plot: Path | None, status: str) -> None:
        import wandb

        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
        tables: dict[str, Any] = {}
        if plot is not None:
            tables["reward_curve"] = wandb.Image(str(plot))
        start, final = summary.get("eval_sets_start") or {}, summary.get("eval_sets_final") or {}
        if final:  # one row per (eval set, metric): before RL and at the end
            rows = [
                [name, metric, (start.get(name) or {}).get(metric), value]
                for name, metrics in final.items()
                for metric, value in metrics.items()
            ]
            tables["eval_sets"] = wandb.Table(columns=["set", "metric", "start", "final"], data=rows)
        if tables:
            self.run.log(tables)
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class MetricsSink:
    """One per run, in the driver. MLflow holds params (flattened config), per-step metrics, artefacts;
    TensorBoard (``logger=tensorboard``, or ``logger.tensorboard=true`` next to another logger) gets the
    per-step scalars and the config as text, in ``<run dir>/tensorboard``; W&B (``logger=wandb`` or
    ``logger.wandb=true``) the config, the metrics, the plot and the eval tables, in ``<run dir>/wandb``."""

    def __init__(self, cfg: RelaxConfig, resolved: dict[str, Any]) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        write_atomic(self.out / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(resolved)))
        # a new file: a run that resumes rewrites it from its checkpoint's history (checkpoint.rewind_sink),
        # and rows left by an attempt killed before its first checkpoint would repeat their steps
        self.jsonl = open(self.out / "metrics.jsonl", "w")  # noqa: SIM115  (open for the run's lifetime)
        self.history: list[dict[str, float]] = []
        self.mlflow = None
        self.tensorboard = None
        self.wandb = None
        if cfg.logger.name == "mlflow":
            self._start_mlflow(resolved)
        if cfg.logger.name == "tensorboard" or cfg.logger.tensorboard:
            self._start_tensorboard()
        if cfg.logger.name == "wandb" or cfg.logger.wandb:
            self.wandb = WandbRun(cfg.logger, resolved, self.out)

    def _start_tensorboard(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = self.out / "tensorboard"
        self.tensorboard = SummaryWriter(log_dir=str(folder))
        config = (self.out / "config.yaml").read_text()
        self.tensorboard.add_text("config", "```\n" + config + "\n```")
        log.info("TensorBoard events in %s (tensorboard --logdir %s)", folder, folder)

    def _start_mlflow(self, resolved: dict[str, Any]) -> None:
        uri = self.cfg.logger.tracking_uri or f"sqlite:///{(self.out / 'mlflow.db').resolve()}"
        params = {k: str(v)[:6000] for k, v in flatten(resolved).items()}
        self.mlflow = MlflowRun(uri, self.cfg.logger, params, self.out / "config.yaml")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        try:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        except OSError as err:
            full = disk_full(err, self.jsonl.name)
            if full is None:
                raise
            raise full from None
        if self.mlflow:
            finite = {k.replace("@", "_"): v for k, v in record.items() if k != "step" and math.isfinite(v)}
            self.mlflow.log_metrics(finite, step)
        if self.wandb:
            self.wandb.log_metrics({k: v for k, v in record.items() if k != "step"}, step)
        if self.tensorboard:
            for key, value in record.items():
                if key != "step" and math.isfinite(value):
                    self.tensorboard.add_scalar(key, value, global_step=step)
            self.tensorboard.flush()

    def plot(self, final_eval: float | None = None) -> Path | None:
        """PNG of the reward per step (mean ± std band) and the eval accuracy points; ``final_eval`` (the
        summary's, taken after the last step when no eval was due then) is drawn at the last step."""
        steps = [r for r in self.history if "reward/mean" in r]
        if not steps:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        x = [r["step"] for r in steps]
        mean = [r["reward/mean"] for r in steps]
        std = [r["reward/std"] for r in steps]
        ax.plot(x, mean, color="tab:blue", lw=1.2, label="train reward (mean)")
        ax.fill_between(
            x,
            [m - s for m, s in zip(mean, std)],
            [m + s for m, s in zip(mean, std)],
            color="tab:blue",
            alpha=0.12,
            label="± std",
        )
        evals = self.eval_points(final_eval)
        if evals:
            ax.plot(
                [step for step, _ in evals],
                [accuracy for _, accuracy in evals],
                "o-",
                color="tab:red",
                label="eval accuracy (greedy, held-out)",
            )
        for (name, metric), points in self.set_points().items():
            steps_, values = zip(*points, strict=True)
            ax.plot(steps_, values, "s--", ms=4, lw=1, label=f"eval {name} {metric}")
        ax.set_xlabel("RL step")
        ax.set_ylabel("reward / accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize="small")
        ax.set_title(f"{self.cfg.algorithm.name} · {self.cfg.model.name} · {self.cfg.mode.name}")
        fig.tight_layout()
        path = self.out / "reward_curve.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def eval_points(self, final_eval: float | None = None) -> list[tuple[int, float]]:
        """(step, eval accuracy) per logged eval, then ``final_eval`` at the last step if none is there."""
        points = [(int(r["step"]), r["eval/accuracy"]) for r in self.history if "eval/accuracy" in r]
        last = max((int(r["step"]) for r in self.history), default=0)
        if final_eval is not None and (not points or points[-1][0] < last):
            points.append((last, final_eval))
        return points

    def set_points(self) -> dict[tuple[str, str], list[tuple[int, float]]]:
        """(set, metric) -> (step, value) for every eval set's greedy accuracy and its pass@k / maj@k at the
        largest k (``eval/<set>/...``, relax_core/evaluation/evaluator.py); the primary set's accuracy is the red line,
        and the untrained model's ``..._init`` figures stay out of the plot."""
        points: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in self.history:
            for key, value in r.items():
                parts = key.split("/")
                if len(parts) != 3 or parts[0] != "eval" or parts[2].endswith("_init"):
                    continue
                if parts[2] == "accuracy" or "@" in parts[2]:
                    points.setdefault((parts[1], parts[2]), []).append((int(r["step"]), value))
        points.pop((self.cfg.eval.primary, "accuracy"), None)
        largest: dict[tuple[str, str], int] = {}
        for name, metric in points:
            if "@" in metric:
                kind, k = metric.split("@")
                largest[name, kind] = max(largest.get((name, kind), 0), int(k))
        return {
            (name, metric): p
            for (name, metric), p in points.items()
            if "@" not in metric or int(metric.split("@")[1]) == largest[name, metric.split("@")[0]]
        }

    def finish(self, summary: dict[str, Any], status: str = "FINISHED") -> None:
        write_atomic(self.out / "summary.json", json.dumps(summary, indent=2))
        plot = self.plot(summary.get("eval_accuracy_final")) if self.cfg.logger.plot else None
        if self.mlflow:
            self.mlflow.finish(
                {f"summary/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float))},
                [p for p in (plot, self.out / "summary.json") if p],
                status,
            )
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.finish(summary, plot, status)
        self.jsonl.close()
