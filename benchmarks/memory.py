"""The memory doctor's prediction against the measured peak of each role: RSS per process on the CPU,
``torch.cuda.max_memory_allocated`` per role on a GPU.

    python benchmarks/memory.py                          # tiny, cluster=in_process and Ray (cluster=local)
    python benchmarks/memory.py --sizes tiny,25m,340m --clusters in_process --steps 2
    python benchmarks/memory.py --device cuda            # on a GPU: 25M, 340M and 0.5B, one role a process

Each point launches ``python -m relax_launch`` with a few RL steps, samples the RSS of the launcher and every
process below it (Ray's workers included) every 0.1 s, and prints one JSON line per role process:
``predicted_mb`` (``relax_core.preflight.memory.estimate`` of the same overrides, no run needed), ``measured_mb``
(that process's peak RSS) and ``ratio`` (predicted / measured). ``data.max_prompt_len`` is set to the
task's longest prompt, so the doctor's worst case (every row at its length limits) is the run's.
The 25M and 340M sizes are random-init Qwen3 twins (hidden 512 x 8 layers, 1536 x 12 layers) of the tiny
builder; 340M on 2 cores takes minutes per step.

On a GPU (``--device cuda``) each point builds one role in a fresh process from the composed config, as the
run would (the Actor's backend in bf16 with fp32 master weights, or the torch engine), and takes one step at
the doctor's worst case: one optimizer step over ``rollout.batch_size x n_samples_per_prompt`` rows with every
prompt and response at its length limit, or one generation of that many samples with EOS ignored. The line
compares the role's predicted items that the allocator holds (all but ``runtime``, the CUDA context, and
``transfer``, the weight buckets no probe fills) with ``max_memory_allocated`` of that process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time

import psutil

SIZES = {
    "tiny": [],
    "25m": ["model.tiny.hidden_size=512", "model.tiny.intermediate_size=1536", "model.tiny.num_hidden_layers=8",
            "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4", "model.tiny.head_dim=64"],
    "340m": ["model.tiny.hidden_size=1536", "model.tiny.intermediate_size=4608", "model.tiny.num_hidden_layers=12",
             "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4", "model.tiny.head_dim=192"],
}  # fmt: skip
# "sort 31524:" is at most 11 characters (one token each) with the default 3-5 digits
RUN = ["data.max_prompt_len=11", "trainer.sft_warmup_steps=2", "trainer.eval_every=1000", "logger=jsonl"]
# a GPU point: both roles on one GPU as in scripts/gpu_check.sh, rows 64 + 192 tokens long, bf16 training
GPU_RUN = ["cluster=in_process", "trainer.num_gpus=0.5", "rollout.num_gpus=0.5", "data.max_prompt_len=64",
           "rollout.max_new_tokens=192", "model.dtype=bfloat16", "trainer.sft_warmup_steps=0"]  # fmt: skip
GPU_SIZES = {**SIZES, "0p5b": ["model=qwen3_0p5b_random"]}
# (size, roles, extra overrides)
GPU_POINTS = [
    ("25m", "actor,engine", []),
    ("340m", "actor,engine", []),
    ("0p5b", "actor,engine", []),
    ("0p5b", "actor", ["model.gradient_checkpointing=true"]),
    ("0p5b", "actor", ["trainer.fsdp=true"]),
    ("0p5b", "engine", ["rollout.dtype=bfloat16"]),
]
# predicted items outside the allocator's count
NOT_ALLOCATED = ("runtime", "transfer")


def _role(cmdline: list[str]) -> str | None:
    """The role a process runs: Ray titles an actor's worker ``ray::<Class>``; the launcher is relax_launch."""
    text = " ".join(cmdline)
    if text.startswith("ray::"):
        return text.split()[0].removeprefix("ray::").split(".")[0]
    if "relax_launch" in text:
        return "launcher"
    return None


def measure(overrides: list[str], out_dir: str) -> dict[str, int]:
    """Peak RSS (bytes) per role process of one run."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax_launch", *overrides, f"hydra.run.dir={out_dir}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    root, peaks, names = psutil.Process(proc.pid), {}, {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for p in procs:
                try:
                    role = _role(p.cmdline())
                    if role:
                        names[p.pid] = role
                        peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.1)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, err = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"run failed: {err[-2000:]}")
    return {f"{names[pid]} ({pid})": peak for pid, peak in peaks.items()}


def probe(role: str, overrides: list[str]) -> dict[str, float]:
    """In this fresh process: build ``role`` (actor or engine) on the GPU from the composed config and take
    one step at the worst case the doctor sizes; the allocator's peak (the process's peak RSS where no GPU
    is: a dry run of the probe on the CPU)."""
    import torch
    from omegaconf import OmegaConf

    from relax_launch.cli import compose_config
    from relax_models.loader import load_tokenizer, resolve_model_path

    cfg = OmegaConf.to_object(compose_config(overrides))
    with tempfile.TemporaryDirectory() as folder:
        path = resolve_model_path(cfg.model, folder, cfg.seed)
        tokenizer = load_tokenizer(path)
        prompt, response = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
        rows = cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt
        gen = torch.Generator().manual_seed(0)

        def tokens(n: int) -> list[int]:
            return torch.randint(3, len(tokenizer), (n,), generator=gen).tolist()

        start = time.perf_counter()
        if role == "actor":
            from relax_core.algorithms.objective import micro_batch_weight, policy_objective, sequence_count
            from relax_core.backends import build_backend
            from relax_core.samples import Sample, TrainBatch

            t = cfg.trainer
            backend = build_backend(t.backend, path, t, cfg.model, cfg.rollout.temperature, cfg.seed)
            samples = [
                Sample(i // 8, i % 8, tokens(prompt), tokens(response), [0.0] * response, [1] * response)
                for i in range(rows)
            ]
            batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
            batch.extras["advantages"] = torch.linspace(-1, 1, rows).unsqueeze(1) * batch.loss_mask
            total, seqs = float(batch.loss_mask.sum()), sequence_count(batch, cfg.algorithm)

            def loss_fn(micro, logprobs, entropy):
                weight = micro_batch_weight(micro, total, seqs, cfg.algorithm)
                return policy_objective(micro, logprobs, entropy, cfg.algorithm, weight)

            # the second step is the steady state: AdamW's moments exist from the first step's end
            backend.train_step(batch, loss_fn, t.micro_batch_size)
            reset_peak()
            static = float(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0.0
            backend.train_step(batch, loss_fn, t.micro_batch_size)
        else:
            from relax_core.engines import build_engine
            from relax_core.engines.base import GenerationRequest, SamplingParams

            engine = build_engine("torch", path, tokenizer, cfg.model, cfg.seed, rollout_cfg=cfg.rollout)
            reset_peak()
            static = float(torch.cuda.memory_allocated()) if torch.cuda.is_available() else 0.0
            requests = [GenerationRequest(tokens(prompt), f"r{i}") for i in range(cfg.rollout.batch_size)]
            sampling = SamplingParams(
                max_new_tokens=response, n=cfg.rollout.n_samples_per_prompt, ignore_eos=True
            )
            engine.generate(requests, sampling)
        if not torch.cuda.is_available():
            rss = float(psutil.Process().memory_info().rss)
            return {"measured": rss, "reserved": rss, "probe_s": time.perf_counter() - start}
        torch.cuda.synchronize()
        return {
            "measured": float(torch.cuda.max_memory_allocated()),
            "static": static,  # held before the measured step: weights, optimizer state, the engine's cache
            "reserved": float(torch.cuda.max_memory_reserved()),
            "probe_s": time.perf_counter() - start,
        }


def reset_peak() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def parse_points(text: str) -> list[tuple[str, str, list[str]]]:
    """``size:roles[:override,...]`` points separated by ``;`` (roles: ``actor``, ``engine`` or both)."""
    points = []
    for point in filter(None, text.split(";")):
        size, roles, *extra = point.split(":", 2)
        points.append((size, roles, extra[0].split(",") if extra else []))
    return points


def gpu_points(points: list[tuple[str, str, list[str]]]) -> None:
    """One JSON line per (point, role): the doctor's allocator items against the probe's peak."""
    from omegaconf import OmegaConf

    from relax_core.preflight.memory import estimate
    from relax_launch.cli import compose_config

    for size, roles, extra in points:
        overrides = [*GPU_RUN, *GPU_SIZES[size], *extra]
        report = estimate(OmegaConf.to_object(compose_config(overrides)))
        held = [r for d in report.devices for r in d.roles]
        for role in roles.split(","):
            prefix = "actor" if role == "actor" else "rollout engine"
            memory = next(r for r in held if r.role.startswith(prefix))
            items = {k: v for k, v in memory.items.items() if k not in NOT_ALLOCATED}
            # the role's total (gradients apart from the graph where it says so) less what no probe holds
            predicted = memory.total - sum(v for k, v in memory.items.items() if k in NOT_ALLOCATED)
            child = subprocess.run(
                [sys.executable, __file__, "--probe", role, "--", *overrides],
                capture_output=True,
                text=True,
            )
            row = {"device": "cuda", "size": size, "extra": extra, "role": memory.role}
            if child.returncode:
                print(json.dumps(row | {"error": child.stderr[-1500:]}), flush=True)
                continue
            got = json.loads(child.stdout.strip().splitlines()[-1])
            row |= {
                "predicted_mb": round(predicted / 2**20),
                "measured_mb": round(got["measured"] / 2**20),
                "reserved_mb": round(got["reserved"] / 2**20),
                "static_mb": round(got.get("static", 0.0) / 2**20),
                "ratio": round(predicted / got["measured"], 3),
                "items_mb": {k: round(v / 2**20) for k, v in items.items()},
                "probe_s": round(got["probe_s"], 1),
            }
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny")
    parser.add_argument("--clusters", default="in_process,local")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--points", help="GPU points 'size:roles[:override,...];...' (default: GPU_POINTS)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # child process: the role to build and step
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe(args.probe, args.overrides)), flush=True)
        return
    if args.device == "cuda":
        gpu_points(parse_points(args.points) if args.points else GPU_POINTS)
        return
    from omegaconf import OmegaConf

    from relax_core.preflight.memory import estimate
    from relax_launch.cli import compose_config

    for size in args.sizes.split(","):
        for cluster in args.clusters.split(","):
            overrides = [f"cluster={cluster}", f"trainer.total_steps={args.steps}", *RUN, *SIZES[size]]
            report = estimate(OmegaConf.to_object(compose_config(overrides)))
            predicted = [(d.name, d.total) for d in report.devices]
            with tempfile.TemporaryDirectory() as out_dir:
                t0 = time.time()
                measured = measure(overrides, out_dir)
                wall = time.time() - t0
            for name, bytes_ in predicted:
                # the prediction's process: the launcher itself in_process, else the Ray actor of that role
                key = "launcher" if cluster == "in_process" else _ray_class(name)
                match = [v for k, v in measured.items() if k.startswith(key)]
                peak = max(match) if match else None
                print(
                    json.dumps(
                        {
                            "size": size,
                            "cluster": cluster,
                            "process": name,
                            "predicted_mb": round(bytes_ / 2**20),
                            "measured_mb": round(peak / 2**20) if peak else None,
                            "ratio": round(bytes_ / peak, 3) if peak else None,
                            "run_s": round(wall, 1),
                        }
                    ),
                    flush=True,
                )
            others = {k: round(v / 2**20) for k, v in measured.items()}
            print(json.dumps({"size": size, "cluster": cluster, "all_processes_mb": others}), flush=True)


def _ray_class(process: str) -> str:
    """The Ray actor class that hosts a predicted process (relax_core/roles)."""
    if "rollout engine" in process and "actor" in process:
        return "Colocated"
    if "rollout engine" in process:
        return "Rollout"
    return process.removeprefix("process ").split()[0].capitalize()


if __name__ == "__main__":
    main()
