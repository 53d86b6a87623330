"""R3, rollout routing replay (issue 47): the torch engine records each token's MoE experts, the Actor's
backend replays them, and rollout engines that cannot record are refused at launch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from relax_core.backends.torch_backend import TorchBackend
from relax_core.config.schema import ModelConfig, TrainerConfig
from relax_core.databus import InMemoryDataBus, partition_name
from relax_core.databus.ray_bus import pack, unpack
from relax_core.databus.records import FORWARD_FIELDS, SAMPLE_FIELDS, batch_from_rows, get_rows, sample_rows
from relax_core.engines.base import GenerationRequest, SamplingParams
from relax_core.engines.torch_engine import TorchEngine
from relax_core.errors import RelaxUserError
from relax_core.preflight.validation import validate
from relax_core.samples import Sample, TrainBatch
from relax_models.loader import load_causal_lm, load_tokenizer
from relax_models.routing_replay import moe_routers, not_recorded, record_routing
from relax_models.tiny_multimodal import build_tiny_qwen3_moe

MODEL = ModelConfig(name="tiny_qwen3_moe", family="qwen3_moe")
TRAINER = TrainerConfig(lr=1e-3, lr_decay="constant", grad_clip=1e6)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_qwen3_moe(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=3))


@pytest.fixture(scope="module")
def rollout_samples(moe_folder: str) -> list[Sample]:
    """8 samples (4 prompts x 2) of the torch engine with routing recorded."""
    tok = load_tokenizer(moe_folder)
    model = load_causal_lm(moe_folder, family="qwen3_moe").eval()
    engine = TorchEngine(
        model, tok.pad_token_id, [tok.eos_token_id], seed=0, family="qwen3_moe", record_routing=True
    )
    prompts = [tok(f"sort {p}:", add_special_tokens=False).input_ids for p in ("31524", "42", "987654", "1")]
    requests = [GenerationRequest(p, str(i)) for i, p in enumerate(prompts)]
    results = engine.generate(requests, SamplingParams(max_new_tokens=12, n=2))
    samples = []
    for i, r in enumerate(results):
        prompt = prompts[i // 2]
        # the prompt and every response token fed back (all but the last), in uint8 for 4 experts
        assert r.routing.dtype == torch.uint8 and r.routing.shape == (
            len(prompt) + len(r.output_ids) - 1,
            2,
            2,
        )
        samples.append(
            Sample(
                i // 2, i % 2, prompt, r.output_ids, r.logprobs, [1] * len(r.output_ids), routing=r.routing
            )
        )
    return samples


@pytest.fixture(scope="module")
def rollout_batch(moe_folder: str, rollout_samples: list[Sample]) -> TrainBatch:
    """The samples as a batch in hand (mode=colocate), advantages of both signs."""
    batch = TrainBatch.from_samples(rollout_samples, load_tokenizer(moe_folder).pad_token_id)
    batch.extras["advantages"] = torch.linspace(-1.0, 1.0, len(batch)).unsqueeze(1) * batch.loss_mask
    return batch


def backend(
    folder: str, replay: bool, router_noise: float = 0.0, checkpointing: bool = False, **trainer
) -> TorchBackend:
    """A trainer whose routers are perturbed by ``router_noise`` (relative): its top-k flips on near ties."""
    b = TorchBackend(
        folder, replace(TRAINER, **trainer), replace(MODEL, gradient_checkpointing=checkpointing)
    )
    b.routing_replay = replay
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in moe_routers(b.model):
            router.weight.add_(
                torch.randn(router.weight.shape, generator=gen) * router_noise * router.weight.abs().mean()
            )
    return b


def abs_diff(b: TorchBackend, batch: TrainBatch) -> float:
    lp = b.forward_logprobs(batch)
    return float(((lp - batch.rollout_logprobs).abs() * batch.loss_mask).sum() / batch.loss_mask.sum())


def test_replay_removes_the_routing_flips_mismatch_and_changes_nothing_without_flips(
    moe_folder: str, rollout_batch: TrainBatch
) -> None:
    same = [abs_diff(backend(moe_folder, replay), rollout_batch) for replay in (False, True)]
    assert max(same) < 1e-6, same  # identical weights: the engine's routing is the trainer's own

    perturbed = backend(moe_folder, False, router_noise=0.05, share_prompts=False)
    with record_routing(perturbed.model) as calls:
        off = abs_diff(perturbed, rollout_batch)
    own, recorded = (
        calls[0].view(rollout_batch.routing.shape).sort(-1).values,
        rollout_batch.routing.sort(-1).values,
    )
    flipped = ((own != recorded) & (recorded != not_recorded(torch.uint8))).any(-1)
    assert flipped.any()  # the perturbed router picks other experts for some tokens
    perturbed.routing_replay = True
    on = abs_diff(perturbed, rollout_batch)
    assert on < off / 4, (on, off)


def test_replay_keeps_router_gradients_also_through_checkpointed_recompute(
    moe_folder: str, rollout_batch: TrainBatch
) -> None:
    def router_grads(b: TorchBackend) -> list[torch.Tensor]:
        b.train_step(rollout_batch, lambda mb, lp, ent: (-(lp * mb.extras["advantages"]).sum(), {}), 4)
        return [r.weight.grad.clone() for r in moe_routers(b.model)]

    plain, replayed = router_grads(backend(moe_folder, False)), router_grads(backend(moe_folder, True))
    for a, b in zip(plain, replayed, strict=True):
        assert b.abs().sum() > 0 and torch.allclose(a, b, atol=1e-7)  # same routing: the model's own gradient
    # flipped routing: the checkpointed backward reruns each forward with the replayed experts too
    flat = router_grads(backend(moe_folder, True, router_noise=0.3))
    rerun = router_grads(backend(moe_folder, True, router_noise=0.3, checkpointing=True))
    for a, b in zip(flat, rerun, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_routing_crosses_the_data_bus_and_replays_as_in_hand(
    moe_folder: str, rollout_samples: list[Sample], rollout_batch: TrainBatch
) -> None:
    """mode=async: each row's routing travels the bus with its tokens (flat, as the Ray bus packs rows), and
    the replaying Actor's log-probs of the rows read back equal those of the batch in hand."""
    keys, fields = sample_rows(rollout_samples, 0)
    bus, part = InMemoryDataBus(), partition_name(1)
    bus.put(part, keys, unpack(pack(fields)))  # what the Ray bus's server holds
    rows = unpack(pack(get_rows(bus, part, keys, SAMPLE_FIELDS + FORWARD_FIELDS)))
    batch = batch_from_rows(rows, load_tokenizer(moe_folder).pad_token_id)
    assert torch.equal(batch.routing, rollout_batch.routing)
    replaying = backend(moe_folder, True, router_noise=0.05)
    assert torch.equal(replaying.forward_logprobs(batch), replaying.forward_logprobs(rollout_batch))


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model=tiny_qwen3_moe", "rollout=vllm"], "rollout=vllm does not report"),
        (["model=tiny_qwen3"], "model.family=qwen3 routes no tokens"),
    ],
)
def test_routing_replay_is_refused_where_nothing_records_it(
    make_cfg, overrides: list[str], needle: str
) -> None:
    with pytest.raises(RelaxUserError) as err:
        validate(make_cfg("algorithm.routing_replay=true", *overrides))
    message = str(err.value)
    assert "\n" not in message and needle in message and "algorithm.routing_replay=false" in message, message
