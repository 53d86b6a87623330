"""Rules across config fields that types alone cannot express; checked before Ray starts."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

import relax_rewards
from relax_core.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from relax_core.errors import RelaxUserError
from relax_core.weight_transfer import STRATEGIES

if TYPE_CHECKING:
    from relax_core.config.schema import RelaxConfig
    from relax_rewards.config import RewardConfig


def _check_choice(key: str, value: str, choices: list[str]) -> None:
    if value not in choices:
        raise RelaxUserError(f"{key}={value!r} is not one of {choices}")


def _check_reward_imports(reward: RewardConfig) -> None:
    """Import the user's reward plug-ins and ``_target_`` here, before Ray: a syntax error or a missing
    module is one line naming the file, not a traceback from inside a rollout engine."""
    from relax_rewards.plugins import import_plugin, load_custom

    checks = [("reward.plugins", p, import_plugin) for p in reward.plugins]
    if reward._target_:
        checks.append(("reward._target_", reward._target_, load_custom))
    for key, value, load in checks:
        try:
            load(value)
        except Exception as err:  # noqa: BLE001  (user code can raise anything while importing)
            if isinstance(err, SyntaxError) and err.filename:
                where = f"{err.filename}, line {err.lineno}: "
            else:
                frames = [
                    f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith("<frozen")
                ]
                user = frames[-1] if frames and "relax_rewards" not in frames[-1].filename else None
                where = f"{user.filename}, line {user.lineno}: " if user else ""
            reason = (str(err).strip().splitlines() or [""])[0]
            raise RelaxUserError(
                f"{key}={value!r} cannot be loaded: {where}{type(err).__name__}: {reason}"
                + ("; fix that file" if where else "")
            ) from None


# families whose models route tokens through relax_models.routing_replay.ROUTER_CLASSES
MOE_FAMILIES = ("qwen3_moe", "qwen3_vl_moe", "qwen3_omni")


def _check_routing_replay(cfg: RelaxConfig) -> None:
    """``algorithm.routing_replay=true`` needs an MoE model, the torch engine (the one that records the experts;
    vLLM's and SGLang's per-token routing output is not wired up) and the single-process torch trainer, with
    single-turn rollouts (the samples that carry routing to the Actor, in the batch or over the data bus)."""
    problem = None
    if cfg.model.family not in MOE_FAMILIES:
        problem = f"model.family={cfg.model.family} routes no tokens to experts (MoE families: {list(MOE_FAMILIES)})"
    elif cfg.rollout.engine != "torch":
        problem = (
            f"rollout={cfg.rollout.engine} does not report its expert routing; only rollout=torch records it"
        )
    elif cfg.trainer.backend != "torch" or cfg.trainer.fsdp:
        problem = f"trainer.backend={cfg.trainer.backend} (fsdp={cfg.trainer.fsdp}) does not replay routing; use trainer=torch"
    elif cfg.rollout.env is not None or cfg.rollout.agent is not None:
        problem = "multi-turn episodes (rollout.env / rollout.agent) carry no routing"
    if problem:
        raise RelaxUserError(
            f"algorithm.routing_replay=true: {problem}; or set algorithm.routing_replay=false"
        )


def validate(cfg: RelaxConfig) -> None:
    """Raise :class:`RelaxUserError` naming the first key whose value cannot work."""
    a, r, t, d = cfg.algorithm, cfg.rollout, cfg.trainer, cfg.data
    _check_choice("algorithm.advantage_estimator", a.advantage_estimator, ADVANTAGE_ESTIMATORS.names())
    _check_choice("algorithm.policy_loss", a.policy_loss, POLICY_LOSSES.names())
    _check_choice("algorithm.loss_agg_mode", a.loss_agg_mode, LOSS_AGGREGATIONS.names())
    _check_choice("algorithm.kl_estimator", a.kl_estimator, KL_ESTIMATORS.names())
    _check_choice("data.on_error", d.on_error, ["raise", "skip"])
    _check_choice("trainer.lr_decay", t.lr_decay, ["constant", "cosine", "linear"])
    if cfg.reward._target_ is None:
        _check_choice("reward.name", cfg.reward.name, relax_rewards.available())
    if r.agent is None and r.env is None:  # agent programs and environments score episodes themselves
        from relax_rewards.preflight import NUM_PROBES, check_reward_config

        _check_reward_imports(cfg.reward)  # first: its message names the user's file and line
        probe_rows = None
        # only a custom reward is probed; a generated dataset's first draws are its probe rows
        if cfg.reward._target_ is not None and not d.train_path and d.synthetic:
            from relax_core.data.synthetic import first_synthetic_rows

            probe_rows = (f"data.synthetic={d.synthetic}", first_synthetic_rows(d, cfg.seed, NUM_PROBES))
        try:
            check_reward_config(cfg.reward, d.label_key, d.train_path, probe_rows=probe_rows)
        except ValueError as err:
            raise RelaxUserError(str(err)) from None
    if t.backend == "megatron":  # first: "this backend cannot train that family" beats "no weights"
        from relax_models.megatron.launch import check_megatron_launch

        check_megatron_launch(cfg)
    from relax_core.data.multimodal import validate_model_and_modality
    from relax_core.runtime.placement import check_gpus, check_training_ranks

    check_training_ranks(cfg)
    check_gpus(cfg)
    from relax_core.preflight.memory import estimate, uses_gpus

    if uses_gpus(cfg):  # a CPU run is never refused: the doctor prints its per-process figures
        problem = estimate(cfg).problem()
        if problem:
            raise RelaxUserError(f"memory: {problem}")
    if t.offload and (cfg.mode.name != "colocate" or t.backend != "torch"):
        raise RelaxUserError(
            f"trainer.offload frees the device between colocate phases of the torch backend; this run has "
            f"mode={cfg.mode.name}, trainer.backend={t.backend}: set trainer.offload=false"
        )

    validate_model_and_modality(cfg)
    if t.lora.rank:
        from relax_core.engines import ENGINES
        from relax_models.lora import check_engine_sync, check_lora_config

        check_lora_config(t.lora, t.backend, t.fsdp)
        check_engine_sync(t.lora, ENGINES.load(cfg.rollout.engine).max_lora_rank)
    for key, value in {
        "rollout.batch_size": r.batch_size,
        "rollout.n_samples_per_prompt": r.n_samples_per_prompt,
        "rollout.max_new_tokens": r.max_new_tokens,
        "rollout.num_engines": r.num_engines,
        "trainer.total_steps": t.total_steps,
        "trainer.micro_batch_size": t.micro_batch_size,
        "algorithm.ppo_epochs": a.ppo_epochs,
    }.items():
        if value < 1:
            raise RelaxUserError(f"{key} must be >= 1, got {value}")
    mt = t.max_tokens_per_micro_batch
    if mt is not None and (mt < 1 or t.backend != "torch"):
        raise RelaxUserError(
            f"trainer.max_tokens_per_micro_batch={mt} needs a count >= 1 and the torch backend (with or "
            f"without FSDP; this run: trainer.backend={t.backend}): set it to null"
        )
    if r.num_engines > r.batch_size:
        raise RelaxUserError(
            f"rollout.num_engines={r.num_engines} exceeds rollout.batch_size={r.batch_size}: some engines would idle"
        )
    if not 0.0 < r.top_p <= 1.0:
        raise RelaxUserError(f"rollout.top_p must be in (0, 1], got {r.top_p}")
    from relax_core.algorithms.checks import validate_algorithm

    validate_algorithm(cfg)  # the algorithm spec's rules: group sizes, roles, loss parameters
    if cfg.mode.max_staleness < 0:
        raise RelaxUserError(f"mode.max_staleness must be >= 0, got {cfg.mode.max_staleness}")
    if cfg.mode.name == "colocate" and cfg.mode.max_staleness != 0:
        raise RelaxUserError(
            "mode=colocate is strictly on-policy: mode.max_staleness must be 0 (use mode=async)"
        )
    if t.sft_warmup_steps and not d.label_key:
        raise RelaxUserError(
            "trainer.sft_warmup_steps needs data.label_key (labels are the warm-start targets)"
        )
    if r.agent is not None:
        from relax_core.agentic.validation import validate_agent_program

        validate_agent_program(cfg)
    elif r.env is not None:
        from relax_core.agentic.validation import validate_agentic

        validate_agentic(cfg)
    _check_choice("weight_transfer", cfg.weight_transfer.name, STRATEGIES)
    if cfg.weight_transfer.bucket_mb <= 0:
        raise RelaxUserError(f"weight_transfer.bucket_mb must be > 0, got {cfg.weight_transfer.bucket_mb}")
    if cfg.mode.name == "async":
        from relax_core.modes.asynchronous import validate_async

        validate_async(cfg)
    from relax_core.engines import ENGINES, engine_dtype

    _check_choice("rollout.engine", r.engine, ENGINES.names())
    if r.engine in ("vllm", "sglang"):
        from relax_core.weight_transfer.server_push import SERVER_PUSHES

        SERVER_PUSHES.load(r.server_weight_update)  # before a server starts, one line naming the choices
    engine_dtype(r.dtype)  # names the key when the dtype is unknown
    if a.routing_replay:
        _check_routing_replay(cfg)
    if r.max_running < r.n_samples_per_prompt:
        raise RelaxUserError(
            f"rollout.max_running={r.max_running} is below rollout.n_samples_per_prompt={r.n_samples_per_prompt}"
        )
    if r.kv_cache_tokens is not None and r.kv_cache_tokens < r.n_samples_per_prompt * (r.max_new_tokens + 1):
        # the engine refuses a longer prompt at run time; this catches a budget no prompt can fit
        raise RelaxUserError(
            f"rollout.kv_cache_tokens={r.kv_cache_tokens} cannot hold one prompt's {r.n_samples_per_prompt} "
            f"samples (rollout.n_samples_per_prompt) of rollout.max_new_tokens={r.max_new_tokens} tokens plus "
            f"their prompt: set it to at least n_samples_per_prompt x (longest prompt + max_new_tokens), or null"
        )
    if r.release_memory_during_train and cfg.mode.name != "colocate":
        raise RelaxUserError(
            f"rollout.release_memory_during_train=true frees engine memory while the trainer steps in "
            f"mode=colocate; mode={cfg.mode.name} generates while it trains: set it false"
        )
    if cfg.control_plane.enabled:
        from relax_core.runtime.http_auth import check_security

        check_security(cfg.control_plane.host, cfg.control_plane.token)
