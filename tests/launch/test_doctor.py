"""The memory doctor: its arithmetic, ``python -m relax_launch.doctor`` and the launcher's refusal of a GPU
config that cannot fit (relax_core/memory.py)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from relax_core.errors import RelaxUserError
from relax_core.memory import GB, arch_from_config, estimate, trainer_memory
from relax_core.validation import validate
from relax_launch.cli import compose_config
from relax_launch.doctor import main as doctor

# a GPU run no 80 GB GPU holds: 30B parameters with AdamW on one unsharded rank
OVERSIZED = ["model=qwen3_30b_a3b", "cluster.num_gpus=1", "rollout.num_gpus=0.5", "trainer.num_gpus=0.5"]


def _cfg(overrides: list[str]):
    return OmegaConf.to_object(compose_config(overrides))


@pytest.mark.parametrize(
    "fields",
    [
        {"model_type": "qwen3", "tie_word_embeddings": True},
        {
            "model_type": "qwen3_moe",
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
        },
    ],
)
def test_parameter_count_matches_transformers(fields: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = dict(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    config = AutoConfig.for_model(
        fields["model_type"], **dims, **{k: v for k, v in fields.items() if k != "model_type"}
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    assert arch_from_config(config.to_dict()).params == real


def test_trainer_arithmetic_by_hand() -> None:
    cfg = _cfg(["data.max_prompt_len=12", "rollout.max_new_tokens=4", "trainer.micro_batch_size=2"])
    arch = arch_from_config(
        {
            "vocab_size": 10,
            "hidden_size": 4,
            "intermediate_size": 8,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 2,
            "tie_word_embeddings": True,
        }
    )
    # per layer: q 4x4, k and v 4x2 each, o 4x4, q/k norms 2+2, MLP 3x4x8, two norms 4+4; embedding 10x4; final norm 4
    params = 2 * (16 + 8 + 8 + 16 + 4 + 96 + 8) + 40 + 4
    assert arch.params == params == 356
    m = trainer_memory(cfg, arch, "actor", trainable=True)
    assert m.items["weights"] == 4 * params and m.items["gradients"] == 4 * params
    assert m.items["optimizer"] == 8 * params  # two fp32 AdamW moments
    # 2 rows x 16 tokens; per token and layer 4h + 2q + 2kv + 4I = 16 + 8 + 4 + 32 elements, fp32, 2 layers
    assert m.items["activations"] == 2 * 16 * 2 * 60 * 4
    # with checkpointing: each layer's input (h) kept, one layer (60) recomputed
    assert m.other_activations == 2 * 16 * (2 * 4 + 60) * 4
    # [2, 16, 10] fp32 logits, then per response token 4 bytes (gathered) + 6 fp32 copies of 10
    assert m.items["logits"] == 2 * 16 * 10 * 4 + 2 * 4 * 10 * (4 + 24)


def test_doctor_prints_the_default_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor([]) == 0
    out = capsys.readouterr().out
    assert "model.tiny of tiny_qwen3" in out and "process actor + rollout engine 0 (fused)" in out
    assert "verdict: CPU run" in out


@pytest.mark.parametrize("recipe", ["dapo_math_qwen3_4b", "openr1_qwen3_vl_4b", "avqa_qwen3_omni_30b"])
def test_shipped_recipes_fit_their_gpus(recipe: str) -> None:
    report = estimate(_cfg([f"experiment={recipe}"]))
    assert report.gpu and report.capacity == 80 * GB
    assert report.fits, report.table()


def test_doctor_refuses_an_oversized_gpu_config_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(OVERSIZED) == 1
    captured = capsys.readouterr()
    assert "verdict: does NOT fit" in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory: GPU 0 would need")
    assert "optimizer" in lines[0] and "trainer=fsdp" in lines[0]


def test_launcher_refuses_an_oversized_gpu_config_before_anything_starts() -> None:
    with pytest.raises(RelaxUserError) as err:
        validate(_cfg(OVERSIZED))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("memory: GPU 0 would need") and "cluster.gpu_memory_gb=80" in message
    assert "actor rank 0 (torch)'s optimizer" in message and "trainer.dp_size" in message
    # on bigger GPUs the memory check passes and the next one speaks (this config has no weights)
    with pytest.raises(RelaxUserError, match="needs its weights"):
        validate(_cfg([*OVERSIZED, "cluster.gpu_memory_gb=1000"]))
