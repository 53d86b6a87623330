"""The TensorBoard sink writes real event files that TensorBoard's own reader loads back."""

from __future__ import annotations

from omegaconf import OmegaConf

from relax_core.config.schema import RelaxConfig
from relax_core.telemetry.metrics import MetricsSink


def test_tensorboard_sink_writes_scalars_and_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = RelaxConfig()
    cfg.output_dir, cfg.logger.name, cfg.logger.plot = str(tmp_path), "tensorboard", False
    sink = MetricsSink(cfg, OmegaConf.to_container(OmegaConf.structured(cfg)))
    for step, reward in [(1, 0.25), (2, 0.5), (3, float("nan"))]:
        sink.log(step, {"reward/mean": reward, "loss": -reward})
    sink.finish({"status": "finished"})
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.5)]
    assert [e.value for e in events.Scalars("loss")] == [-0.25, -0.5]
    assert "config/text_summary" in events.Tags()["tensors"]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3  # the JSONL record stays


def test_jsonl_logger_writes_no_events(tmp_path):
    cfg = RelaxConfig()
    cfg.output_dir, cfg.logger.name, cfg.logger.plot = str(tmp_path), "jsonl", False
    sink = MetricsSink(cfg, {})
    sink.log(1, {"reward/mean": 1.0})
    sink.finish({})
    assert not (tmp_path / "tensorboard").exists()
