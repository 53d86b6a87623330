"""Relax colocate vs TRL's GRPOTrainer on the same work, back to back: speed, memory, learning.

    python benchmarks/vs_trl.py                       # 60 steps, seed 1, Relax on Ray and in one process
    python benchmarks/vs_trl.py --steps 150 --seeds 0,1,2 --plot docs/img/vs_trl.png
    python benchmarks/vs_trl.py --steps 150 --seeds 0,1,2 --relax trainer.share_prompts=false  # the plain forward
    python benchmarks/vs_trl.py --same-batch --seeds 0,1,2    # one step of each tool on one batch, compared

TRL 1.16.0 goes into its own venv (``~/.cache/relax/trl-venv``, ``--trl-venv``; created once, ~1 min):
it is a benchmark peer, never a Relax dependency. Its side runs this same file with ``--trl-worker``.

Same work for both, per seed: one tiny random-init Qwen3 folder (the default experiment's shape, hidden 128, 4
layers, ~0.8M parameters, built by ``relax_models.tiny`` with the seed), the default digits task (``sort
31524:`` -> ``12345``, per-position partial credit, train/eval files written once), 16 prompts x 8 samples per
step, <= 8 new tokens, temperature 1, lr 1e-3 with linear decay to 0 and no warm-up (TRL's default;
``trainer.lr_decay=linear trainer.min_lr_ratio=0`` in Relax), AdamW betas (0.9, 0.99), no weight decay,
grad-norm clip 1, pure RL GRPO (no warm-start, no KL, no entropy bonus), one optimizer step per rollout batch,
2 torch threads, fp32 (TRL's ``bf16`` default is turned off), evaluation by greedy decoding alone (Relax's
default eval set also samples 8 answers per prompt for pass@k before and after RL, which TRL does not).
Relax runs ``python -m relax_launch`` (colocate,
torch engine) twice: ``relax`` on Ray (``cluster=local``: a Ray node, the driver and one worker holding Actor
and engine) and ``relax_in_process`` (``cluster=in_process``: no Ray, every role in the launcher's process);
TRL runs ``GRPOTrainer`` (HF ``generate()`` in the training process). Prompt order differs (each tool's own
sampler), so reward curves match in distribution, not step by step.

One JSON line per (tool, seed):

* ``s_per_step``: median step time after ``--warmup`` steps (Relax: ``step_time_s`` of metrics.jsonl, i.e.
  rollout + scoring + train + weight publish; TRL: time between consecutive ``on_step_end`` callbacks,
  i.e. generation + scoring + forward/backward/step + its logging). ``train_s_per_step``: Relax's
  ``time/train_s`` (the Actor call: forward, backward, optimizer step); TRL's step time minus its
  ``_generate_and_score_completions`` (timed by wrapping that method in the worker).
* ``total_wall_s``: the whole command, start-up and evaluations included.
* ``peak_rss_mb``: peak of the summed RSS of the process and all its descendants (Ray's GCS, raylet and
  workers for Relax), sampled every 50 ms. Summed RSS counts shared pages once per process, so it
  overstates multi-process runs somewhat; it is the number a user's memory monitor shows.
* ``peak_pss_mb``: the same tree's peak summed PSS (proportional set size: a page shared by k processes
  counts 1/k in each, so the sum is the RAM the run really holds), sampled every 0.5 s since reading it
  costs more.
* ``rewards``: mean train reward per step; ``eval_reward`` / ``eval_accuracy``: greedy decoding of the 128
  eval prompts after the last step (reward and exact-match share).

Then one ``summary`` line per tool (means over seeds) and ``<relax tool>_vs_trl``: Relax / TRL ratios, and the
greedy eval reward difference paired by seed (mean, standard error, seeds where Relax is higher). The plot
draws each seed's reward curve up to 3 seeds per tool, else each tool's mean over seeds with a ±1 std band.

Objective audit (TRL 1.16.0 ``trl/trainer/grpo_trainer.py`` and ``grpo_config.py`` read in its venv, against
Relax's ``relax_core.algorithms``), at the settings above:

* advantage: both (r - mean_group) / (std_group + eps) with the unbiased group std (``torch.std``); TRL's
  eps is 1e-4, Relax's 1e-6. Digit rewards are multiples of 1/5..1/8, so a group with unequal rewards has
  std >= ~0.04 and the eps changes advantages by < 0.3 %; equal rewards give 0 in both.
* loss: both on-policy PPO-clip with ratio exp(logp - logp.detach()) = 1, so clipping (TRL eps 0.2 / 0.2,
  Relax 0.2 / 0.28 + dual clip 3) never binds and the gradient is -A * grad log p per token in both.
* aggregation: TRL ``loss_type="dapo"`` divides the summed token losses by the number of completion tokens
  of the whole generation batch (all processes); Relax ``token-mean`` divides by the trained tokens of the
  optimizer batch. One batch per step here: the same normaliser.
* mask: TRL masks completion tokens after the first EOS and keeps the EOS; Relax's engine stops at EOS and
  trains on the response including it. Truncated completions are trained in both.
* log-probs: both at temperature 1 over the full vocabulary, logits of the prompt+completion forward. TRL
  left-pads prompts (Relax right-pads): pads are masked and RoPE depends only on relative positions, so the
  scores agree up to rounding.
* schedule: TRL linear decay to 0 without warm-up (HF ``get_linear_schedule_with_warmup``, its LambdaLR
  starts at 1 and reaches 0 at ``max_steps``); Relax ``lr_decay=linear, min_lr_ratio=0``: (T - s) / T, the
  same values.
* optimizer: TRL uses HF Trainer's default ``adamw_torch_fused`` (torch AdamW, fused kernel, eps 1e-8), Relax
  torch AdamW (foreach, eps 1e-8): the same update up to float rounding. betas are set to (0.9, 0.99) for both
  here: HF's default beta2 is 0.999, Relax's 0.99 (a real difference between the two tools' defaults).
  Grad-norm clip 1.0 and weight decay 0 in both.
* sampling: TRL's default ``top_k=0``, ``top_p=1``, temperature 1 with HF ``generate()``; Relax samples the
  same distribution (inverse CDF, one uniform per row) and stops at EOS.
* dropout: none in either (TRL's ``disable_dropout`` defaults to False, the tiny Qwen3's attention_dropout is 0).

``--same-batch`` checks this audit by running it: TRL takes one step (``max_steps=1``) and records the rows it
generated, the gradients its optimizer gets and its parameter updates; Relax's ``Advantages`` and ``Actor``
roles, configured by the launch's own overrides, take one step on the same rows. One JSON line per seed:
reward, loss, entropy and grad norm of both, and the cosine and norm ratio of the gradients and of the updates.

So no difference in the objective explains a learning gap at these settings; what differs is the random
stream (prompt order, generation noise; the model init is shared), so compare over several seeds. Between the
two tools' *defaults* three things do differ, and this script pins each to one value for both: the schedule
(TRL linear to 0, Relax ``lr_decay=constant`` in the schema, cosine to 0.1 in ``conf/trainer/torch.yaml``), Adam's
beta2 (0.999 vs 0.99) and the entropy bonus (Relax's ``algorithm=grpo`` has ``entropy_coef=0.01``, TRL none).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
ENV = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# the shared settings (see the module docstring)
PROMPTS, SAMPLES, NEW_TOKENS, LR, BETA2 = 16, 8, 8, 1e-3, 0.99


# ---------------------------------------------------------------------------------------- measurement
class PeakTreeMemory(threading.Thread):
    """Peaks of the summed RSS and PSS of ``pid`` and its descendants; remembers every process it saw."""

    def __init__(self, pid: int, interval_s: float = 0.05, pss_every: int = 10) -> None:
        super().__init__(daemon=True)
        import psutil

        self.root = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.pss_every = pss_every
        self.peak_pss_bytes = 0
        self.peak_by_process: dict[str, int] = {}  # RSS per process at the peak, by process title
        self.seen: dict[int, object] = {}
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        sample = 0
        while not self._stop_event.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            sizes, pss = {}, 0
            for p in procs:
                try:
                    sizes[f"{p.pid} {' '.join(p.cmdline())[:80]}"] = p.memory_info().rss
                    pss += p.memory_full_info().pss if sample % self.pss_every == 0 else 0
                    self.seen.setdefault(p.pid, p)
                except psutil.Error:
                    pass
            if sum(sizes.values()) > self.peak_bytes:
                self.peak_bytes, self.peak_by_process = sum(sizes.values()), sizes
            self.peak_pss_bytes = max(self.peak_pss_bytes, pss)
            sample += 1
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def kill_leftovers(self) -> int:
        """SIGKILL descendants that outlived the run (e.g. Ray processes), by the exact processes seen."""
        import psutil

        left = [p for p in self.seen.values() if p.is_running()]
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        return len(left)


def run_measured(cmd: list[str], log_path: Path, env: dict[str, str]) -> tuple[int, float, float, float]:
    """Run ``cmd`` to completion: (return code, wall seconds, peak process-tree RSS and PSS in MB); the RSS of
    each process at the RSS peak goes to ``<log>.rss.json``."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        monitor = PeakTreeMemory(proc.pid)
        monitor.start()
        code = proc.wait()
    wall = time.perf_counter() - t0
    monitor.stop()
    monitor.kill_leftovers()
    by_process = {
        k: round(v / 2**20) for k, v in sorted(monitor.peak_by_process.items(), key=lambda kv: -kv[1])
    }
    log_path.with_suffix(".rss.json").write_text(json.dumps(by_process, indent=1))
    return code, wall, monitor.peak_bytes / 2**20, monitor.peak_pss_bytes / 2**20


def median_after(values: list[float], warmup: int) -> float:
    return statistics.median(values[warmup:] if len(values) > warmup else values)


# ---------------------------------------------------------------------------------------- shared inputs
def build_inputs(folder: Path, seed: int) -> dict:
    """The model folder and the digits train/eval files both tools read."""
    import dataclasses

    from relax_core.config.schema import DataConfig, TinyModelSpec
    from relax_core.data.prompts import generate_synthetic
    from relax_models.tiny import build_tiny_qwen3

    dims = {k: v for k, v in dataclasses.asdict(TinyModelSpec()).items() if v is not None}
    model = build_tiny_qwen3(folder / "model", seed=seed, **dims)
    train, eval_ = generate_synthetic(DataConfig(synthetic="digits"), folder / "data", seed)
    return {"model": str(model), "train": train, "eval": eval_}


# ---------------------------------------------------------------------------------------- Relax side
# Relax's launchers the benchmark compares, by tool name
RELAX_CLUSTERS = {"relax": "local", "relax_in_process": "in_process"}
# the plot draws every seed's curve up to this many seeds per tool, else their mean and spread
MAX_SEED_LINES = 3
SEED_STYLES = ["-", "--", ":", "-."]


def relax_overrides(inputs: dict, steps: int, seed: int, threads: int, extra: list[str]) -> list[str]:
    """The Relax side of the shared settings (see the module docstring), as command-line overrides."""
    return [
        f"seed={seed}",
        f"model.path={inputs['model']}",
        f"data.train_path={inputs['train']}",
        f"data.eval_path={inputs['eval']}",
        f"trainer.total_steps={steps}",
        "trainer.sft_warmup_steps=0",
        "trainer.lr_decay=linear",
        "trainer.min_lr_ratio=0",
        f"trainer.lr={LR}",
        f"trainer.betas=[0.9,{BETA2}]",
        f"trainer.eval_every={steps}",
        "eval.sets.heldout.n_samples=0",  # TRL's evaluation is the greedy pass alone: no pass@k sampling
        "trainer.export_final_model=false",
        "algorithm=grpo",
        "algorithm.entropy_coef=0",
        "algorithm.kl_loss_coef=0",
        f"rollout.batch_size={PROMPTS}",
        f"rollout.n_samples_per_prompt={SAMPLES}",
        f"rollout.max_new_tokens={NEW_TOKENS}",
        f"trainer.num_threads={threads}",
        f"rollout.num_threads={threads}",
        "logger=jsonl",
        "logger.plot=false",
        *extra,
    ]


def run_relax(
    tool: str, inputs: dict, steps: int, seed: int, out: Path, warmup: int, threads: int, overrides: list[str]
) -> dict:
    cmd = [sys.executable, "-m", "relax_launch", f"cluster={RELAX_CLUSTERS[tool]}", f"hydra.run.dir={out}"]
    cmd += relax_overrides(inputs, steps, seed, threads, overrides)
    code, wall, peak, peak_pss = run_measured(cmd, out.with_suffix(".log"), ENV)
    if code != 0:
        return {"tool": tool, "seed": seed, "error": out.with_suffix(".log").read_text()[-3000:]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rl = [r for r in rows if r["step"] > 0]
    last = rl[-1]
    return {
        "tool": tool,
        "seed": seed,
        "steps": len(rl),
        "s_per_step": round(median_after([r["step_time_s"] for r in rl], warmup), 4),
        "train_s_per_step": round(median_after([r["time/train_s"] for r in rl], warmup), 4),
        "rollout_s_per_step": round(median_after([r["time/rollout_s"] for r in rl], warmup), 4),
        "weight_sync_s_per_step": round(median_after([r["time/weight_sync_s"] for r in rl], warmup), 4),
        "total_wall_s": round(wall, 1),
        "peak_rss_mb": round(peak),
        "peak_pss_mb": round(peak_pss),
        "eval_reward": round(last["eval/reward"], 4),
        "eval_accuracy": round(last["eval/accuracy"], 4),
        "rewards": [round(r["reward/mean"], 4) for r in rl],
    }


# ---------------------------------------------------------------------------------------- TRL side
def ensure_trl_venv(venv: Path) -> Path:
    """TRL in its own venv (idempotent): torch first (the CPU wheel), then TRL with our transformers."""
    import importlib.metadata

    python = venv / "bin" / "python"
    probe = f"import trl, sys; sys.exit(trl.__version__ != {TRL_VERSION!r})"
    if python.exists() and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0:
        return python
    print(json.dumps({"event": "installing TRL", "venv": str(venv)}), file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    torch_version = importlib.metadata.version("torch").split("+")[0]
    subprocess.run([*pip, f"torch=={torch_version}"], check=True)
    subprocess.run(
        [
            *pip,
            "-c",
            str(ROOT / "constraints.txt"),
            f"trl=={TRL_VERSION}",
            "accelerate",
            "datasets",
            f"transformers=={importlib.metadata.version('transformers')}",
            "tokenizers",
            "psutil",
        ],
        check=True,
    )
    return python


def start_trl_worker(python: Path, spec: dict, out: Path) -> tuple[int, float, float, float]:
    """Run :func:`trl_worker` in the TRL venv on ``spec``, in folder ``out``; as :func:`run_measured`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec | {"out": str(out)}))
    # PYTHONPATH: the worker imports relax_rewards (pure Python) for the very same reward function
    env = ENV | {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(python), str(Path(__file__).resolve()), "--trl-worker", str(out / "spec.json")]
    return run_measured(cmd, out / "run.log", env)


def run_trl(python: Path, inputs: dict, steps: int, seed: int, out: Path, warmup: int, threads: int) -> dict:
    spec = inputs | {"steps": steps, "seed": seed, "threads": threads}
    code, wall, peak, peak_pss = start_trl_worker(python, spec, out)
    if code != 0:
        return {"tool": "trl", "seed": seed, "error": (out / "run.log").read_text()[-3000:]}
    result = json.loads((out / "result.json").read_text())
    return {
        "tool": "trl",
        "seed": seed,
        "steps": len(result["rewards"]),
        "s_per_step": round(median_after(result["step_s"], warmup), 4),
        "train_s_per_step": round(
            median_after([s - g for s, g in zip(result["step_s"], result["generate_s"])], warmup), 4
        ),
        "rollout_s_per_step": round(median_after(result["generate_s"], warmup), 4),
        "total_wall_s": round(wall, 1),
        "peak_rss_mb": round(peak),
        "peak_pss_mb": round(peak_pss),
        "eval_reward": round(result["eval_reward"], 4),
        "eval_accuracy": round(result["eval_accuracy"], 4),
        "rewards": [round(r, 4) for r in result["rewards"]],
    }


def trl_worker(spec_path: str) -> None:
    """Inside the TRL venv: GRPOTrainer on the shared inputs, then greedy eval; writes result.json.

    With ``same_batch`` in the spec: one step, no eval; writes ``same_batch.pt`` with the step's rows
    (prompt and completion ids, labels), its logged metrics, gradients (as the optimizer gets them) and
    parameter updates."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relax_rewards.digits import digits_reward

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)

    def rows(path: str) -> list[dict]:
        return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]

    record: dict = {"labels": [], "logs": {}}

    def reward(completions: list[str], label: list[str], **_) -> list[float]:
        if spec.get("same_batch"):
            record["labels"] += label
        return [digits_reward(c, lab)["score"] for c, lab in zip(completions, label)]

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.last, self.step_s, self.rewards = time.perf_counter(), [], []

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.step_s.append(now - self.last)
            self.last = now

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if spec.get("same_batch"):
                record["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append(float(logs["reward"]))
                record["logs"] = {k: float(logs[k]) for k in ("reward", "loss", "entropy", "grad_norm")}

    config = GRPOConfig(
        output_dir=spec["out"],
        use_cpu=True,
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=PROMPTS * SAMPLES,  # counted in completions
        num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        adam_beta2=BETA2,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        bf16=False,  # fp32 like Relax here: TRL's default bf16 autocast is emulated (~8x slower) without AVX-512
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    clock = StepClock()
    train = Dataset.from_list([{"prompt": r["prompt"], "label": r["label"]} for r in rows(spec["train"])])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    generate_s: list[float] = []
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate_and_score(*a, **kw):  # generation + rewards + advantages of one step
        t0 = time.perf_counter()
        out = generate_and_score(*a, **kw)
        generate_s.append(time.perf_counter() - t0)
        return out

    trainer._generate_and_score_completions = timed_generate_and_score
    if spec.get("same_batch"):
        same_batch_step(trainer, tokenizer, record, Path(spec["out"]) / "same_batch.pt")
        return
    clock.last = time.perf_counter()
    trainer.train()
    model = trainer.model.eval()
    evals = rows(spec["eval"])
    batch = tokenizer([r["prompt"] for r in evals], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **batch, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=tokenizer.pad_token_id
        )
    texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
    scores = [digits_reward(t, r["label"]) for t, r in zip(texts, evals)]
    result = {
        "step_s": clock.step_s,
        "generate_s": generate_s,
        "rewards": clock.rewards,
        "eval_reward": sum(s["score"] for s in scores) / len(scores),
        "eval_accuracy": sum(s["acc"] for s in scores) / len(scores),
    }
    (Path(spec["out"]) / "result.json").write_text(json.dumps(result))


def same_batch_step(trainer, tokenizer, record: dict, path: Path) -> None:
    """TRL's one training step (``max_steps`` is 1), recording the rows it generates and what it does with
    them: completions cut after their first EOS, as TRL's completion mask does."""
    import torch

    model = trainer.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    generate = model.generate

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        prompts, mask = kwargs["input_ids"], kwargs["attention_mask"].bool()
        eos = tokenizer.eos_token_id
        record["prompt_ids"] = [row[m].tolist() for row, m in zip(prompts, mask)]
        completions = [row.tolist() for row in out[:, prompts.shape[1] :]]
        record["completion_ids"] = [c[: c.index(eos) + 1] if eos in c else c for c in completions]
        return out

    model.generate = recording_generate
    trainer.train()
    record["updates"] = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    torch.save(record, path)


def relax_same_batch(inputs: dict, record: dict, seed: int, threads: int, extra: list[str]) -> dict:
    """Relax's Advantages and Actor roles, configured as the benchmark's launch, take one step on the rows
    TRL generated; compared with TRL's step on them: gradient and update directions and sizes."""
    import torch
    from hydra import compose, initialize_config_module

    import relax_launch.cli  # noqa: F401  (registers the structured-config schema with Hydra)
    from relax_core.roles.actor import Actor
    from relax_core.roles.advantages import Advantages
    from relax_core.samples import Sample, TrainBatch
    from relax_models.loader import load_tokenizer
    from relax_rewards.digits import digits_reward

    with initialize_config_module("relax_launch.conf", version_base="1.3"):
        cfg = compose("config", overrides=relax_overrides(inputs, 1, seed, threads, extra))
    tokenizer = load_tokenizer(inputs["model"])
    samples = []
    rows = zip(record["prompt_ids"], record["completion_ids"], record["labels"], strict=True)
    for i, (prompt, completion, label) in enumerate(rows):  # TRL's order: a prompt's samples in a run
        text = tokenizer.decode(completion, skip_special_tokens=True)
        logprobs, mask = [0.0] * len(completion), [1] * len(completion)  # on-policy: logprobs unused
        score = digits_reward(text, label)["score"]
        samples.append(
            Sample(i // SAMPLES, i % SAMPLES, prompt, completion, logprobs, mask, text, label, reward=score)
        )
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    batch.extras["advantages"] = Advantages(cfg).compute(batch)
    actor = Actor(cfg, inputs["model"])
    before = {n: p.detach().clone() for n, p in actor.backend.model.named_parameters()}
    metrics = actor.train(1, batch)
    params = dict(actor.backend.model.named_parameters())

    def compare(name: str, relax: dict, trl: dict) -> dict[str, float]:
        """Cosine and norm ratio (Relax / TRL) of two per-parameter tensor sets, as flat vectors."""
        a = torch.cat([relax[n].flatten() for n in sorted(trl)]).double()
        b = torch.cat([trl[n].flatten() for n in sorted(trl)]).double()
        cosine = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
        return {
            f"{name}_cosine": round(cosine, 6),
            f"{name}_norm_ratio": round(float(a.norm() / b.norm()), 5),
        }

    trl = record["logs"]
    both = {"reward": float(batch.rewards.mean())} | {k: metrics[k] for k in ("loss", "entropy", "grad_norm")}
    return (
        {"same_batch": seed}
        | {k: [round(v, 6), round(trl[k], 6)] for k, v in both.items()}
        | compare("grad", {n: p.grad for n, p in params.items()}, record["grads"])
        | compare("update", {n: p.detach() - before[n] for n, p in params.items()}, record["updates"])
    )


def same_batch(python: Path, folder: Path, seed: int, threads: int, extra: list[str]) -> dict:
    """``--same-batch`` for one seed: TRL's recorded step, then Relax's on its rows, compared."""
    import torch

    inputs = build_inputs(folder, seed)
    out = folder / "same_batch"
    spec = inputs | {"steps": 1, "seed": seed, "threads": threads, "same_batch": True}
    if start_trl_worker(python, spec, out)[0] != 0:
        raise SystemExit((out / "run.log").read_text()[-3000:])
    record = torch.load(out / "same_batch.pt", weights_only=False)
    return relax_same_batch(inputs, record, seed, threads, extra)


# ---------------------------------------------------------------------------------------- report
def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"relax": "tab:blue", "relax_in_process": "tab:green", "trl": "tab:orange"}
    by_tool: dict[str, list[dict]] = {}
    for r in results:
        if "rewards" in r:
            by_tool.setdefault(r["tool"], []).append(r)
    ray_runs, in_process = by_tool.get("relax", []), by_tool.get("relax_in_process", [])
    if ray_runs and [r["rewards"] for r in ray_runs] == [r["rewards"] for r in in_process]:
        del by_tool["relax"]  # the same curves: one set of lines names both launchers
    labels = {"relax_in_process": "relax = relax_in_process"} if "relax" not in by_tool and ray_runs else {}
    ray_speed = {r["seed"]: r["s_per_step"] for r in ray_runs}
    for tool, runs in by_tool.items():
        name = labels.get(tool, tool)
        if len(runs) <= MAX_SEED_LINES:  # one line per seed
            for r in runs:
                speed = f"{ray_speed[r['seed']]:.3f} / " if name != tool else ""
                label = f"{name} seed {r['seed']} (eval {r['eval_reward']:.2f}, {speed}{r['s_per_step']:.3f} s/step)"
                ax.plot(
                    range(1, len(r["rewards"]) + 1),
                    r["rewards"],
                    color=colors[tool],
                    ls=SEED_STYLES[r["seed"] % len(SEED_STYLES)],
                    lw=1.1,
                    label=label,
                )
            continue
        # many seeds: their mean per step, a band of one standard deviation across seeds
        steps = min(len(r["rewards"]) for r in runs)
        per_step = [[r["rewards"][i] for r in runs] for i in range(steps)]
        mean = [statistics.mean(v) for v in per_step]
        std = [statistics.stdev(v) for v in per_step]
        evals = [r["eval_reward"] for r in runs]
        x = range(1, steps + 1)
        label = (
            f"{name}, mean of {len(runs)} seeds (eval {statistics.mean(evals):.3f} ± "
            f"{statistics.stdev(evals):.3f}, {statistics.median(r['s_per_step'] for r in runs):.3f} s/step)"
        )
        ax.plot(x, mean, color=colors[tool], lw=1.3, label=label)
        ax.fill_between(
            x,
            [m - d for m, d in zip(mean, std)],
            [m + d for m, d in zip(mean, std)],
            color=colors[tool],
            alpha=0.2,
        )
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean train reward (digits, partial credit)")
    ax.set_title("Relax colocate vs TRL GRPOTrainer: same model, task and settings")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(results: list[dict]) -> list[dict]:
    """Means over seeds per tool, then Relax / TRL ratios (< 1: Relax is faster / smaller)."""
    keys = ["s_per_step", "train_s_per_step", "total_wall_s", "peak_rss_mb", "peak_pss_mb"]
    keys += ["eval_reward", "eval_accuracy"]
    by_tool: dict[str, list[dict]] = {}
    for r in results:
        if "error" not in r:
            by_tool.setdefault(r["tool"], []).append(r)
    means = {
        tool: {k: round(statistics.mean(r[k] for r in runs), 4) for k in keys}
        for tool, runs in by_tool.items()
    }
    lines = [{"summary": tool, "seeds": [r["seed"] for r in by_tool[tool]]} | m for tool, m in means.items()]
    for tool in RELAX_CLUSTERS:
        if {tool, "trl"} <= means.keys():
            relax, trl = means[tool], means["trl"]
            ratios = {
                f"{k}_ratio": round(relax[k] / trl[k], 3)
                for k in ("s_per_step", "train_s_per_step", "peak_rss_mb", "peak_pss_mb")
            }
            lines.append({f"{tool}_vs_trl": ratios | paired_eval_difference(by_tool[tool], by_tool["trl"])})
    return lines


def paired_eval_difference(relax: list[dict], trl: list[dict]) -> dict:
    """Greedy eval reward, Relax − TRL, paired by seed (both tools are deterministic per seed, so the spread
    is the seeds'): mean, its standard error (from 2 seeds on) and on how many seeds Relax is higher."""
    trl_eval = {r["seed"]: r["eval_reward"] for r in trl}
    diffs = [r["eval_reward"] - trl_eval[r["seed"]] for r in relax if r["seed"] in trl_eval]
    if not diffs:
        return {}
    out = {
        "eval_reward_diff": round(statistics.mean(diffs), 4),
        "seeds_relax_higher": sum(d > 0 for d in diffs),
    }
    if len(diffs) > 1:
        out["eval_reward_diff_se"] = round(statistics.stdev(diffs) / len(diffs) ** 0.5, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seeds", default="1", help="comma-separated, e.g. 0,1,2")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median step time")
    parser.add_argument("--tools", default="relax,relax_in_process,trl")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each tool (and Relax role)")
    parser.add_argument("--trl-venv", type=Path, default=Path("~/.cache/relax/trl-venv").expanduser())
    parser.add_argument("--plot", type=Path, default=Path("outputs/vs_trl.png"))
    parser.add_argument("--out", type=Path, default=None, help="run folders (default: a temp dir)")
    parser.add_argument(
        "--relax",
        nargs="*",
        default=[],
        help="extra overrides of the Relax run, e.g. trainer.share_prompts=false",
    )
    parser.add_argument(
        "--same-batch",
        action="store_true",
        help="instead: one step of each tool on the same generated batch, compared (checks the objective audit)",
    )
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return
    tools = args.tools.split(",")
    python = ensure_trl_venv(args.trl_venv) if "trl" in tools or args.same_batch else None
    root = args.out or Path(tempfile.mkdtemp(prefix="relax-vs-trl-"))
    if args.same_batch:
        for seed in [int(s) for s in args.seeds.split(",")]:
            print(
                json.dumps(same_batch(python, root / f"seed{seed}", seed, args.threads, args.relax)),
                flush=True,
            )
        return
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        inputs = build_inputs(root / f"seed{seed}", seed)
        for tool in tools:  # back to back, same inputs
            out = root / f"seed{seed}" / tool
            if tool in RELAX_CLUSTERS:
                result = run_relax(tool, inputs, args.steps, seed, out, args.warmup, args.threads, args.relax)
            else:
                result = run_trl(python, inputs, args.steps, seed, out, args.warmup, args.threads)
            print(json.dumps(result), flush=True)
            results.append(result)
    for line in summarize(results):
        print(json.dumps(line), flush=True)
    plot(results, args.plot)
    print(json.dumps({"plot": str(args.plot), "runs": str(root)}), flush=True)


if __name__ == "__main__":
    main()
