"""Rollout role: prompts -> sampled responses scored by the reward hub."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from relax_core.data.multimodal import MediaPrompts
from relax_core.databus import DataBus
from relax_core.databus.stages import BusProducer
from relax_core.engines import adapter_sync_rank, build_engine
from relax_core.engines.base import GenerationRequest, GenerationResult, SamplingParams
from relax_core.engines.resumable import ResumableEngine
from relax_core.resilience.health import apply_reward, mark_reward_error, reward_problem
from relax_core.roles import use_threads
from relax_core.samples import PromptRecord, Sample, SampleStatus
from relax_core.weight_transfer import WeightReceiver
from relax_models.loader import load_tokenizer
from relax_models.lora import merged_payload
from relax_rewards.executor import RewardExecutor, RewardItem

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig

FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


class Rollout(WeightReceiver, BusProducer):
    """One rollout engine plus the reward executor; replicas split a step's prompts between them.

    ``generate`` returns scored samples to the caller (colocate); ``produce`` writes them to the DataBus
    ``bus`` chunk by chunk (async). New weights may arrive while it generates (``load_weights``).
    """

    def __init__(
        self,
        cfg: RelaxConfig,
        model_path: str,
        replica: int = 0,
        engine_url: str | None = None,
        bus: DataBus | None = None,
    ) -> None:
        use_threads(cfg.rollout.num_threads)
        self.cfg = cfg
        self.bus = bus
        self.tokenizer = load_tokenizer(model_path)
        # engine_url: an external SGLang-compatible server this actor drives over HTTP (elastic scale-out)
        engine = build_engine(
            cfg.rollout.engine,
            model_path,
            self.tokenizer,
            cfg.model,
            seed=cfg.seed * 1000 + replica,
            rollout_cfg=cfg.rollout,
            engine_url=engine_url,
            record_routing=cfg.algorithm.routing_replay,
            lora_rank=adapter_sync_rank(cfg),
        )
        # an engine that serves no LoRA (an external one joining a vLLM run) loads adapter payloads merged
        self.merge_adapters = engine.max_lora_rank is None
        self.engine = ResumableEngine(engine, cfg.mode.partial_rollout)
        self.rewards = RewardExecutor.from_config(cfg.reward)
        # multimodal prompts arrive with media references; their tensors are built here, once per prompt,
        # and the prompt's n samples reference them
        self.media = MediaPrompts.from_config(cfg.modality, model_path)
        self.multi_turn = None
        if cfg.rollout.env is not None:  # agentic: episodes against an environment (relax_core/agentic)
            from relax_core.agentic import MultiTurnRunner

            self.multi_turn = MultiTurnRunner(
                cfg.rollout, self.tokenizer, model_path, seed=cfg.seed * 1000 + replica
            )
        self.plays_episodes = self.multi_turn is not None

    def _sampling(self, greedy: bool) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=0.0 if greedy else r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            n=1 if greedy else r.n_samples_per_prompt,
        )

    def generate(
        self, prompts: list[PromptRecord], greedy: bool = False, sampling: SamplingParams | None = None
    ) -> list[Sample]:
        """``n_samples_per_prompt`` scored samples per prompt (one when greedy), or as ``sampling`` (an
        evaluation's) says; group id = prompt index."""
        if sampling is not None and sampling.seed is not None:
            return self._generate_seeded(prompts, sampling)
        sampling = sampling or self._sampling(greedy)
        if self.media is not None:
            prompts = self.media.materialize(prompts)
        if self.multi_turn is not None:  # environments report rewards themselves: checked like any other
            samples = self.multi_turn.generate(self.engine, prompts, sampling, self.score)
            for s in samples:
                problem = reward_problem(float(s.reward), self.cfg.reward.max_abs)
                if problem is not None:
                    mark_reward_error(s, f"environment: {problem}")
            return samples
        requests = [GenerationRequest(p.prompt_ids, str(p.index), p.multimodal_inputs) for p in prompts]
        results = self.engine.generate(requests, sampling)
        samples = []
        for j, result in enumerate(results):
            prompt = prompts[j // sampling.n]
            samples.append(
                Sample(
                    group_id=prompt.index,
                    index_in_group=j % sampling.n,
                    prompt_ids=prompt.prompt_ids,
                    response_ids=result.output_ids,
                    rollout_logprobs=result.logprobs,
                    loss_mask=[1] * len(result.output_ids),
                    response_text=self.tokenizer.decode(result.output_ids, skip_special_tokens=True),
                    label=prompt.label,
                    metadata=prompt.metadata,
                    multimodal_inputs=prompt.multimodal_inputs,
                    status=FINISH_STATUS[result.finish_reason],
                    policy_version=result.weight_version,
                    routing=result.routing,
                )
            )
        self.score(samples)
        return samples

    def _generate_seeded(self, prompts: list[PromptRecord], sampling: SamplingParams) -> list[Sample]:
        """Sampled evaluation on its own seed: the training draws after it are those a run without it
        makes (the engine's generator and torch's global RNG are put back)."""
        saved = self.rng_state()
        generator = getattr(self.engine, "generator", None)
        if generator is not None:
            generator.manual_seed(sampling.seed)
        try:
            return self.generate(prompts, sampling=replace(sampling, seed=None))
        finally:
            self.set_rng_state(saved)

    def complete(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        """Raw continuations of token-level requests, unscored (the agent endpoint's calls)."""
        return self.engine.generate(requests, sampling)

    def score(self, samples: list[Sample]) -> None:
        """Fill ``reward``/``reward_extras``; a reward that fails scores 0 and is counted."""
        items = [RewardItem(s.uid, s.response_text, s.label, s.metadata, s.group_id) for s in samples]
        for sample, outcome in zip(samples, self.rewards.score(items), strict=True):
            apply_reward(sample, outcome, self.cfg.reward.max_abs)

    @property
    def resumed(self) -> int:
        return self.engine.resumed

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.engine.swap(merged_payload(state_dict) if self.merge_adapters else state_dict, version)

    def sync_metrics(self) -> dict[str, float]:
        """What the newest weight update moved into the engine (its ``sync_stats``)."""
        return dict(self.engine.engine.sync_stats)

    def load_weights_folder(self, folder: str, version: int) -> None:
        """Weights from an HF folder (the ``disk`` channel; external engine servers load it themselves)."""
        self.engine.swap_from_disk(folder, version)

    def health(self) -> bool:
        return self.engine.health()

    def abort(self) -> None:
        self.engine.abort()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def rng_state(self) -> dict:
        """Sampling RNG of the engine and torch's global RNG: saved in checkpoints so that a resumed run draws
        the same samples the uninterrupted one would."""
        generator = getattr(self.engine, "generator", None)
        return {
            "generator": generator.get_state() if generator is not None else None,
            "torch": torch.get_rng_state(),
        }

    def set_rng_state(self, state: dict) -> None:
        generator = getattr(self.engine, "generator", None)
        if generator is not None and state.get("generator") is not None:
            generator.set_state(state["generator"])
        torch.set_rng_state(state["torch"])

    def shutdown(self) -> None:
        self.rewards.close()
        self.engine.shutdown()
