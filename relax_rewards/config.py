"""Schema of the ``reward`` config group (``conf/reward/``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class JudgeConfig:
    """``reward.judge``: generative-reward judge engines that the run starts and owns (``reward=genrm``).

    Set ``path`` (an HF folder) or ``model`` (a random-init ``conf/model/tiny_*`` spec built into
    ``<run dir>/judge_init``, for tests); with neither, genrm calls the judge at ``reward.kwargs.url``.
    """

    # local HF model folder of the judge
    path: str | None = None
    # a tiny model spec of conf/model (e.g. tiny_qwen3), built in-process: no download
    model: str | None = None
    # judge engine processes behind one router URL
    num_engines: int = 1
    # each judge engine's server: "torch" (Relax's engine server) or "vllm" (vLLM's, in its own interpreter:
    # vllm_python, else $RELAX_VLLM_PYTHON or the scripts/install_vllm_cpu.sh venv, as for rollout=vllm)
    engine: str = "torch"
    vllm_python: str | None = None
    # torch CPU threads per judge engine
    num_threads: int = 1
    dtype: str = "float32"
    # what each judge engine reserves in Ray's placement (its own bundle, on any node with room): logical CPUs,
    # and GPUs (0: the engine runs on the CPU and sees no GPU; 1: a GPU of its own, which no other role gets)
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    # samples one judge engine decodes together (concurrent judge requests share decode steps)
    max_running: int = 64
    # a judge engine not answering /health by then stops the launch with one line
    startup_timeout_s: float = 300.0
    # how often the judge engines are probed; a dead one is restarted on its port
    health_interval_s: float = 1.0
    # an engine whose process lives but has not answered /health for this long is hung: it is killed and
    # started again like a dead one
    hang_timeout_s: float = 60.0
    # how long a judge request waits at the router for an engine that is up before it is refused (503)
    wait_s: float = 5.0

    @property
    def managed(self) -> bool:
        """The run starts judge engines (a model is named), rather than calling ``reward.kwargs.url``."""
        return bool(self.path or self.model)


@dataclass
class RewardConfig:
    """Which reward scores a response, and how the executor runs it."""

    # a registered reward (relax_rewards.available()); per-sample metadata.rm_type overrides it
    name: str = "digits"
    # dotted path "pkg.mod.fn" or "path/to/file.py:fn" of a custom reward; wins over ``name``
    _target_: str | None = None
    # for dict-valued rewards: the entry that becomes the training reward
    key: str | None = None
    # options passed to the reward function as keyword arguments
    kwargs: dict[str, Any] = field(default_factory=dict)
    # >0: a process pool of that size (a reward that hangs, exits or crashes costs only its samples);
    # 0: in the calling process (no crash isolation: a reward calling os._exit ends the run)
    num_workers: int = 1
    # per-call limit, counted from the call's own start; calls run concurrently, so many hung calls cost
    # about one timeout
    timeout_s: float = 10.0
    # calls running at once per worker process (or in this process when num_workers=0)
    concurrency: int = 64
    # a reward (any source: function, remote/judge, agent program) beyond ±max_abs, or not finite, is a
    # reward error (scored 0, counted in reward/reward_error): larger values overflow the advantages
    max_abs: float = 1e6
    # modules ("pkg.mod" or "path/to/file.py") imported first; the rewards they @register can then be
    # chosen by name, including by a sample's rm_type (which never loads code by path itself)
    plugins: list[str] = field(default_factory=list)
    # how worker processes start: "spawn" (default: clean, sees the current sys.path), "forkserver", "fork"
    start_method: str = "spawn"
    # judge engines this run starts for reward=genrm (conf/reward/genrm.yaml); null for other rewards
    judge: JudgeConfig | None = None
