"""The memory doctor: its arithmetic, ``python -m relax_launch.doctor`` and the launcher's refusal of a GPU
config that cannot fit (relax_core/preflight/memory.py)."""

from __future__ import annotations

import pytest
import torch

from relax_core.errors import RelaxUserError
from relax_core.preflight.memory import GB, arch_from_config, engine_memory, estimate, trainer_memory
from relax_core.preflight.validation import validate
from relax_core.runtime.placement import check_gpus
from relax_launch.doctor import main as doctor
from tests.core.conftest import typed_config

# a GPU run no 80 GB GPU holds: 30B parameters with AdamW on one unsharded rank
OVERSIZED = ["model=qwen3_30b_a3b", "cluster.num_gpus=1", "rollout.num_gpus=0.5", "trainer.num_gpus=0.5"]


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
    cfg = typed_config(*SHORT)
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
    # 2 rows x 16 tokens, 2 layers; per token and layer in fp32: the norms' inputs and outputs 4h x 4 bytes,
    # the q/k/v and gate/up inputs 2h x 4, q and k by their norms 4 + rotary/attention 3 x 4 bytes per
    # (q + kv) element, the log-sum-exp 4 per head, the MLP 4I x 4: 64 + 32 + 96 + 8 + 128 = 328 bytes
    assert arch.activation_bytes(4, 4, autocast=False) == 328
    assert m.items["activations"] == 2 * 16 * 2 * 328
    # with checkpointing: each layer's input (h, fp32) kept, one layer recomputed
    assert m.other_activations == 2 * 16 * (2 * 4 * 4 + 328)
    # bf16 autocast over fp32 weights (torch backend): an fp32 residual stream, each of the 5 input
    # projections casting its own bf16 copy: 64 + 5 x 4 x 2 + (4 + 6) x 6 + 8 + 4 x 2 x 8 = 236 bytes
    bf16 = trainer_memory(typed_config(*SHORT, "model.dtype=bfloat16"), arch, "actor", trainable=True)
    assert bf16.items["activations"] == 2 * 16 * 2 * 236
    # FSDP's mixed precision: bf16 weights, a bf16 residual stream, shared projection inputs: 180 bytes
    fsdp = trainer_memory(
        typed_config(*SHORT, "model.dtype=bfloat16", "trainer.fsdp=true"), arch, "actor", True
    )
    assert fsdp.items["activations"] == 2 * 16 * 2 * 180
    # [2, 16, 10] fp32 logits, then per response token 4 bytes (gathered) + 6 fp32 copies of 10
    assert m.items["logits"] == 2 * 16 * 10 * 4 + 2 * 4 * 10 * (4 + 24)


def test_doctor_prints_the_default_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor([]) == 0
    out = capsys.readouterr().out
    assert "model.tiny of tiny_qwen3" in out and "process actor + rollout engine 0 (fused)" in out
    assert "verdict: CPU run" in out


@pytest.mark.parametrize("recipe", ["dapo_math_qwen3_4b", "openr1_qwen3_vl_4b", "avqa_qwen3_omni_30b"])
def test_shipped_recipes_fit_their_gpus(recipe: str) -> None:
    node = [] if recipe == "avqa_qwen3_omni_30b" else ["cluster.num_gpus=8"]  # its Slurm job names its nodes
    report = estimate(typed_config(f"experiment={recipe}", *node))
    assert report.gpu and report.capacity == 80 * GB
    assert report.fits, report.table()


@pytest.mark.parametrize("engine", ["sglang"])
def test_doctor_refuses_a_multimodal_recipe_on_an_http_engine_as_the_launcher_does(
    engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The VL recipe's memory fits with any engine, but SGLang is driven with token ids (vLLM takes images):
    the doctor says what the launcher would, instead of "fits"."""
    assert doctor(["experiment=openr1_qwen3_vl_4b", f"rollout={engine}", "cluster.num_gpus=8"]) == 2
    captured = capsys.readouterr()
    assert "verdict" not in captured.out
    assert captured.err.strip() == (
        f"error: rollout={engine} cannot take image inputs yet (its HTTP client sends token ids only, so the "
        "engine would never see the media of modality=vision): use rollout=torch"
    )


def test_doctor_refuses_an_oversized_gpu_config_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(OVERSIZED) == 1
    captured = capsys.readouterr()
    assert "verdict: does NOT fit" in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory: GPU 0 would need")
    assert "optimizer" in lines[0] and "trainer=fsdp" in lines[0]


def test_launcher_refuses_an_oversized_gpu_config_before_anything_starts() -> None:
    with pytest.raises(RelaxUserError) as err:
        validate(typed_config(*OVERSIZED))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("memory: GPU 0 would need") and "cluster.gpu_memory_gb=80" in message
    assert "actor rank 0 (torch)'s optimizer" in message and "trainer.dp_size" in message
    # on bigger GPUs the memory check passes and the next one speaks (this config has no weights)
    with pytest.raises(RelaxUserError, match="needs its weights"):
        validate(typed_config(*OVERSIZED, "cluster.gpu_memory_gb=1000"))


# the hand-sized model above: hidden 4, q 2x2, kv 1x2, MLP 8, 2 layers, vocab 10, tied (356 parameters)
SMALL = {
    "vocab_size": 10,
    "hidden_size": 4,
    "intermediate_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 2,
    "tie_word_embeddings": True,
}
SHORT = ["data.max_prompt_len=12", "rollout.max_new_tokens=4", "trainer.micro_batch_size=2"]


@pytest.mark.parametrize("moe", [False, True])
def test_lora_parameter_count_matches_apply_lora(moe: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from relax_core.config.schema import LoRAConfig
    from relax_models.lora import apply_lora, is_adapter

    extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24} if moe else {}
    config = AutoConfig.for_model("qwen3_moe" if moe else "qwen3", **SMALL, **extra)
    lora = LoRAConfig(rank=3)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        apply_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    real = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    assert arch_from_config(config.to_dict()).lora_params(lora.rank, lora.target_modules) == real


def test_lora_trains_only_the_adapters_by_hand() -> None:
    arch = arch_from_config(SMALL)
    full = trainer_memory(typed_config(*SHORT), arch, "actor", trainable=True)
    m = trainer_memory(typed_config(*SHORT, "trainer.lora.rank=2"), arch, "actor", trainable=True)
    # rank x (in + out) per layer: q 4+4, k 4+2, v 4+2, o 4+4, gate 4+8, up 4+8, down 8+4 = 64; 2 layers
    adapters = 2 * 64 * 2
    assert adapters == 256
    assert m.items["optimizer"] == 8 * adapters and full.items["optimizer"] - m.items["optimizer"] == 8 * 100
    assert m.items["gradients"] == 4 * adapters
    assert m.items["weights"] == 4 * (356 + adapters)  # the fp32 base stays, the adapters beside it
    # per token and layer the adapters keep 7 rank-wide x·Aᵀ (fp32) beside the layer's 328 bytes
    assert m.items["activations"] == 2 * 16 * 2 * (328 + 7 * 2 * 4)
    assert m.items["logits"] == full.items["logits"]
    assert "LoRA r2" in m.role
    # the Critic trains no adapters (its backend takes no trainer.lora)
    critic = trainer_memory(typed_config(*SHORT, "trainer.lora.rank=2"), arch, "critic", trainable=True)
    assert critic.items["optimizer"] == 8 * 356


def test_token_budget_sizes_activations_and_logits_by_hand() -> None:
    arch = arch_from_config(SMALL)
    m = trainer_memory(
        typed_config(*SHORT, "trainer.max_tokens_per_micro_batch=40"), arch, "actor", trainable=True
    )
    # 40 tokens (2.5 rows of 12 + 4) instead of 2 rows x 16; per token and layer 328 bytes, 2 layers
    assert m.items["activations"] == 40 * 2 * 328
    # packed Qwen3 rows: logits at the 2.5 x 4 response positions only, then 6 fp32 copies (unchunked)
    assert m.items["logits"] == 10 * 10 * (4 + 24)
    assert "40 tokens/micro-batch packed" in m.role
    # a budget below one row: the row trains alone
    m = trainer_memory(
        typed_config(*SHORT, "trainer.max_tokens_per_micro_batch=8"), arch, "actor", trainable=True
    )
    assert m.items["activations"] == 16 * 2 * 328 and m.items["logits"] == 4 * 10 * (4 + 24)


def test_kv_cache_token_budget_sizes_the_torch_engines_cache_by_hand() -> None:
    arch = arch_from_config(SMALL)
    # the default evaluation's sampled pass asks for 128 prompts x 8 samples at once: 1024 slots of 12 + 4
    # tokens rounded up to 64; K and V, 2 layers, kv_dim 2, fp32
    cfg = typed_config(*SHORT)
    m = engine_memory(cfg, arch, 0, gpu=False, capacity=None)
    assert m.items["kv_cache"] == 2 * 2 * 1024 * 64 * 2 * 4 and m.items["sampling"] == 1024 * 10 * 4 * 3
    # without evaluation sets, a step's 16 x 8 samples in 128 slots
    cfg.eval.sets = {}
    m = engine_memory(cfg, arch, 0, gpu=False, capacity=None)
    assert m.items["kv_cache"] == 2 * 2 * 128 * 64 * 2 * 4 and m.items["sampling"] == 128 * 10 * 4 * 3
    # rollout.kv_cache_tokens=320: at most 320 tokens, 20 rows of 16 decoded at once
    cfg.rollout.kv_cache_tokens = 320
    m = engine_memory(cfg, arch, 0, gpu=False, capacity=None)
    assert m.items["kv_cache"] == 2 * 2 * 320 * 2 * 4 and m.items["sampling"] == 20 * 10 * 4 * 3
    # a budget below one prompt's samples stops the launch in one line naming the setting
    cfg.rollout.kv_cache_tokens = 30
    with pytest.raises(
        RelaxUserError, match=r"^rollout.kv_cache_tokens=30 cannot hold one prompt's 8 samples"
    ):
        validate(cfg)
    # releasing engine memory is colocate's: async engines generate while the trainer steps
    cfg.rollout.kv_cache_tokens = None
    cfg.rollout.release_memory_during_train = True
    validate(cfg)
    cfg.mode.name = "async"
    with pytest.raises(RelaxUserError, match=r"^rollout.release_memory_during_train=true .* mode=async"):
        validate(cfg)


def test_managed_judge_engines_are_processes_of_their_own_by_hand() -> None:
    """reward.judge: each judge engine is a CPU process holding the judge's weights and a dense KV cache of
    its rows (a policy row plus the verdict's tokens); on a GPU run a CPU judge is a note, off the GPUs' table,
    and a GPU judge (reward.judge.num_gpus) takes GPUs of its own."""
    cfg = typed_config("reward=genrm", "reward.judge.model=tiny_qwen3", "reward.judge.num_engines=2")
    report = estimate(cfg)
    judges = [d for d in report.devices if d.name.startswith("process judge engine")]
    assert [d.name for d in judges] == ["process judge engine 0", "process judge engine 1"]
    assert cfg.model.name == "tiny_qwen3"
    arch = report.arch  # the judge is built from the policy's spec here
    rows = min(cfg.reward.judge.max_running, cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt)
    tokens = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens + 16  # genrm's default verdict length
    items = judges[0].roles[0].items
    # the model's weights and the decode layout's fused [q; k; v] and [gate; up] copies
    assert items["engine_weights"] == arch.params * 4 + 4 * 128 * (128 + 2 * 64 + 2 * 384) * 4
    assert items["kv_cache"] == 2 * arch.num_layers * rows * tokens * arch.kv_dim * 4
    recipe = ["experiment=dapo_math_qwen3_4b", "reward=genrm", "reward.judge.model=tiny_qwen3"]
    gpu = estimate(typed_config(*recipe))
    assert not any("judge" in r.role for d in gpu.devices for r in d.roles)
    assert any(n.startswith("1 judge engine(s) on the CPU") for n in gpu.notes)
    # reward.judge.num_gpus: each engine's bundle takes a GPU of its own, past the roles' GPUs
    placed = estimate(typed_config(*recipe, "reward.judge.num_engines=2", "reward.judge.num_gpus=1"))
    judged = [d for d in placed.devices if any("judge" in r.role for r in d.roles)]
    assert [[r.role for r in d.roles] for d in judged] == [
        ["judge engine (torch, float32) 0"],
        ["judge engine (torch, float32) 1"],
    ]
    assert len(placed.devices) == len(gpu.devices) + 2
    with pytest.raises(RelaxUserError, match=r"reward.judge.num_gpus$"):  # 8 GPUs for the roles, no room left
        check_gpus(typed_config(*recipe, "reward.judge.num_gpus=1"))


def test_chunked_logprobs_size_the_logit_buffers_by_hand() -> None:
    from relax_core.algorithms.logprobs import CHUNK_BYTES

    v = 2**20  # a 4-position chunk of fp32 [4, V] is CHUNK_BYTES: 2 rows x 4 response positions are chunked
    assert CHUNK_BYTES // (4 * v) == 4
    arch = arch_from_config({**SMALL, "vocab_size": v})
    m = trainer_memory(typed_config(*SHORT), arch, "actor", trainable=True)
    # [2, 16, V] logits + [2, 4, V] gathered (fp32 model) + four fp32 chunk buffers, instead of 6 fp32 copies
    assert m.items["logits"] == 2 * 16 * v * 4 + 8 * v * 4 + 4 * CHUNK_BYTES
    plain = 2 * 16 * v * 4 + 8 * v * (4 + 24)
    assert plain - m.items["logits"] == 8 * v * 24 - 4 * CHUNK_BYTES
    # packed (budget 32 = 2 rows): no full logits; the backward holds them and their gradient, 3 chunks
    packed = trainer_memory(
        typed_config(*SHORT, "trainer.max_tokens_per_micro_batch=32"), arch, "actor", trainable=True
    )
    assert packed.items["logits"] == 2 * 8 * v * 4 + 3 * CHUNK_BYTES
    # a frozen scorer: the forward only
    ref = trainer_memory(typed_config(*SHORT), arch, "reference", trainable=False)
    assert ref.items["logits"] == 2 * 16 * v * 4 + 8 * v * 4 + 4 * CHUNK_BYTES


def test_packed_families_match_the_torch_backend() -> None:
    from relax_core.backends.torch_backend import PACKED_FAMILIES as backend
    from relax_core.preflight.memory import PACKED_FAMILIES

    assert PACKED_FAMILIES == backend
