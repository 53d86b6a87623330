"""Training an external agent program: episodes go out over HTTP, its OpenAI-compatible calls come back as
trajectories.

With ``rollout.agent.command`` set, the rollout stage does not generate from the prompts itself. The
driver serves :mod:`relax_core.agentic.server` over the run's rollout engines (the :class:`RolloutPool`,
so the endpoint always samples the current policy) and starts ``rollout.agent.num_workers`` copies of the
program with::

    OPENAI_BASE_URL     http://127.0.0.1:<port>/v1   (OPENAI_API_KEY is set too, for OpenAI clients)
    RELAX_EPISODES_URL  POST it for the next episode: {"session_id", "messages", "label", "metadata", ...},
                        or {"done": true} when the run is over (the program then exits)
    RELAX_AGENT_WORKER  this copy's id

A program loops: take an episode, call ``/v1/chat/completions`` with the episode's session id (header
``X-Session-Id`` or the ``user`` field) as often as it likes, and ``POST /v1/sessions/{id}/reward``. A step
posts ``n_samples_per_prompt`` episodes per prompt (``group_id`` = prompt index, so GRPO groups work) and
ends when every one of them is closed. An episode whose program crashes, exits, or sends no reward within
``rollout.agent.episode_timeout_s`` is FAILED (reward 0, loss mask zeroed unless
``rollout.failed_sample_policy=keep``), logged with its session and worker, and the program is restarted;
the step goes on. A program that exits before any copy has taken an episode cannot start: the run stops
with one error naming the command and its last output. Each copy's output is in
``<run dir>/agent_logs/worker-<slot>.log``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import ray

from relax_core.agentic.server import AgentServer, EpisodeBoard, Trajectory, TrajectoryStore, build_app
from relax_core.databus import DataBus
from relax_core.databus.stages import BusProducer
from relax_core.engines.base import GenerationRequest, GenerationResult, SamplingParams
from relax_core.errors import RelaxUserError
from relax_core.samples import PromptRecord, Sample

if TYPE_CHECKING:  # the pool imports the Rollout role, which imports this package
    from relax_core.config.schema import RelaxConfig
    from relax_core.rollout.pool import RolloutPool

log = logging.getLogger("relax")


@dataclass
class PoolEngine:
    """The run's rollout engines as the endpoint's engine: token-level requests routed over the pool."""

    pool: RolloutPool

    def generate(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        return self.pool.complete(requests, sampling)


@dataclass
class Worker:
    """One running copy of the program; ``id`` changes with every restart so stale requests are told apart."""

    slot: int
    id: str
    process: subprocess.Popen
    log_file: IO[bytes]
    log_path: Path


def mask_runs(tokenizer, ids: list[int], mask: list[int]) -> list[dict]:
    """``ids`` as runs of equal loss mask: ``[{"mask": 1, "text": ...}, {"mask": 0, ...}, ...]``."""
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(ids, mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return [{"mask": m, "text": tokenizer.decode(tokens)} for m, tokens in runs]


def last_lines(path: Path, count: int = 5) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(lines[-count:])


class AgentProgramRollout:
    """The rollout stage of ``rollout.agent`` runs: :meth:`generate` has the program play the prompts."""

    def __init__(
        self, cfg: RelaxConfig, pool: RolloutPool | EngineSet, tokenizer, cwd: str | None = None
    ) -> None:
        """``cwd``: where the program starts (a relative command is the driver's: an async run hosts this
        in a Ray actor, whose working directory may differ)."""
        self.cfg = cfg
        self.cwd = cwd
        self.pool = pool
        self.tokenizer = tokenizer
        self.agent = cfg.rollout.agent
        self.command = " ".join(self.agent.command)
        r = cfg.rollout
        sampling = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k
        )
        self.store = TrajectoryStore(open_sessions_only=True, max_abs=cfg.reward.max_abs)
        self.board = EpisodeBoard(self.store, self._is_live)
        app = build_app(
            PoolEngine(pool),
            tokenizer,
            sampling,
            self.store,
            max_context_len=r.max_context_len,
            board=self.board,
        )
        self.server = AgentServer(app)
        self.workers: dict[int, Worker] = {}
        self.log_dir = Path(cfg.output_dir) / "agent_logs"
        self.rounds = 0
        self.restarts = 0
        self.failed = 0
        self.any_episode_taken = False
        self.last_spawn = time.monotonic()

    # ------------------------------------------------------------------ program processes
    def start(self) -> None:
        self.server.start()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # where the endpoint listens, for tools outside the run (like control_plane.json)
        (self.log_dir / "endpoint.json").write_text(json.dumps({"url": self.server.url}))
        for slot in range(self.agent.num_workers):
            self._spawn(slot)
        log.info(
            "agent program: %d x %r against %s/v1 (logs in %s)",
            self.agent.num_workers,
            self.command,
            self.server.url,
            self.log_dir,
        )

    def _spawn(self, slot: int) -> None:
        worker_id = f"{slot}.{self.restarts}"
        env = os.environ | {
            "OPENAI_BASE_URL": f"{self.server.url}/v1",
            "OPENAI_API_KEY": "relax",
            "RELAX_EPISODES_URL": f"{self.server.url}/v1/episodes/next?worker={worker_id}",
            "RELAX_AGENT_WORKER": worker_id,
            "PYTHONUNBUFFERED": "1",
        }
        log_path = self.log_dir / f"worker-{slot}.log"
        log_file = open(log_path, "ab")  # noqa: SIM115  (closed when the worker ends)
        try:
            process = subprocess.Popen(
                list(self.agent.command),
                env=env | dict(self.agent.env),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.cwd,
                start_new_session=True,  # its own process group: a hung program is killed with its children
            )
        except OSError as err:
            log_file.close()
            raise RelaxUserError(f"rollout.agent.command {self.command!r} cannot start: {err}") from None
        self.workers[slot] = Worker(slot, worker_id, process, log_file, log_path)
        self.last_spawn = time.monotonic()  # a starting program gets time before episodes count as idle

    def _is_live(self, worker_id: str | None) -> bool:
        """Programs not started by the run (no worker id) may take episodes too."""
        return worker_id is None or any(w.id == worker_id for w in self.workers.values())

    def _kill(self, worker: Worker) -> None:
        if worker.process.poll() is None:
            try:
                os.killpg(worker.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.process.wait()
        worker.log_file.close()

    def stop(self) -> None:
        self.board.close()  # waiting programs get {"done": true} and exit
        deadline = time.monotonic() + 10
        for worker in self.workers.values():
            try:
                worker.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
            self._kill(worker)
        self.workers = {}
        self.server.stop()

    # ------------------------------------------------------------------ a round of episodes
    def generate(self, prompts: list[PromptRecord], greedy: bool = False) -> list[Sample]:
        """One sample per episode, ``n_samples_per_prompt`` episodes per prompt (one each when greedy)."""
        n = 1 if greedy else self.cfg.rollout.n_samples_per_prompt
        if self.rounds == 0:  # engines still loading must not eat into the programs' episode time
            ray.get(self.pool.call("health"))
        self.rounds += 1
        episodes = [
            Trajectory(
                f"r{self.rounds}-p{p.index}-{k}", group_id=p.index, index_in_group=k, prompt=p, greedy=greedy
            )
            for p in prompts
            for k in range(n)
        ]
        wanted = [e.session_id for e in episodes]
        closed: dict[str, Sample] = {}
        self.board.post(episodes)
        while len(closed) < len(wanted):
            self.store.wait_for_change(0.2)
            closed |= {s.metadata["session_id"]: s for s in self.store.pop_finished()}
            self._supervise()
        self.board.leases.clear()
        samples = [closed[sid] for sid in wanted]
        if self.agent.save_trajectories:
            self._save(samples)
        return samples

    def _save(self, samples: list[Sample]) -> None:
        with open(self.log_dir / "trajectories.jsonl", "a") as f:
            for s in samples:
                record = {
                    "round": self.rounds,
                    "session_id": s.metadata["session_id"],
                    "group_id": s.group_id,
                    "reward": s.reward,
                    "status": str(s.status),
                    "turns": s.num_turns,
                    "error": s.metadata.get("agent_error", ""),
                    "prompt": self.tokenizer.decode(s.prompt_ids),
                    "segments": mask_runs(self.tokenizer, s.response_ids, s.loss_mask),
                }
                f.write(json.dumps(record) + "\n")

    def _supervise(self) -> None:
        """Fail the episodes of exited programs and of overdue sessions, restart those programs."""
        self.any_episode_taken = self.any_episode_taken or bool(self.board.leases)
        for worker in list(self.workers.values()):
            code = worker.process.poll()
            if code is None:
                continue
            if not self.any_episode_taken:
                raise RelaxUserError(
                    f"rollout.agent.command {self.command!r} exited with code {code} before taking an "
                    f"episode; its last output: {last_lines(worker.log_path) or '(none)'}"
                )
            self._fail_worker_sessions(worker, f"the program exited with code {code}")
            self._restart(worker, f"exited with code {code}")
        timeout = self.agent.episode_timeout_s
        now = time.monotonic()
        for session_id, (worker_id, taken) in list(self.board.leases.items()):
            if now - taken <= timeout or session_id not in self.store.live:
                continue
            self._fail(session_id, f"no reward within rollout.agent.episode_timeout_s={timeout}", worker_id)
            worker = next((w for w in self.workers.values() if w.id == worker_id), None)
            if worker is not None:  # presumed hung: its other sessions end too
                self._fail_worker_sessions(worker, "the program was killed after a session timed out")
                self._restart(worker, "killed: a session timed out")
        # programs that stopped asking without holding an episode (a hung one is restarted above)
        open_sessions = any(sid in self.store.live for sid in self.board.leases)
        idle_since = max(self.board.last_taken, self.last_spawn)
        if self.board.pending and not open_sessions and now - idle_since > timeout:
            for traj in self.board.drain_pending():
                self.store.open(traj)
                self._fail(traj.session_id, f"no program took the episode within {timeout}s", None)

    def _fail_worker_sessions(self, worker: Worker, reason: str) -> None:
        for session_id, (worker_id, _taken) in list(self.board.leases.items()):
            if worker_id == worker.id and session_id in self.store.live:
                self._fail(session_id, reason, worker.id)

    def _fail(self, session_id: str, reason: str, worker_id: str | None) -> None:
        keep = self.cfg.rollout.failed_sample_policy == "keep"
        if self.store.fail(session_id, reason, keep_mask=keep) is None:
            return
        self.failed += 1
        who = f"worker {worker_id} of {self.command!r}" if worker_id else repr(self.command)
        log.warning("agent session %s FAILED: %s (%s)", session_id, reason, who)

    def _restart(self, worker: Worker, why: str) -> None:
        self._kill(worker)
        self.restarts += 1
        if self.restarts > self.agent.max_restarts:
            raise RelaxUserError(
                f"rollout.agent.command {self.command!r} was restarted {self.agent.max_restarts} times "
                f"(rollout.agent.max_restarts); last: {why}; its last output: "
                f"{last_lines(worker.log_path) or '(none)'}"
            )
        log.warning("agent program worker %s %s; restarting it", worker.id, why)
        self._spawn(worker.slot)

    def metrics(self) -> dict[str, float]:
        """Counters over the run so far (merged into each step's metrics)."""
        return {"agent/restarts": float(self.restarts), "agent/failed_sessions": float(self.failed)}


class EngineSet:
    """mode=async: the run's rollout actors as the endpoint's pool. Each call goes to the engine with the
    fewest calls outstanding; :meth:`replace` swaps in an engine restarted in place."""

    def __init__(self, engines: list[ray.actor.ActorHandle]) -> None:
        self.engines = list(engines)
        self.outstanding = [0] * len(self.engines)
        self.lock = threading.Lock()

    def replace(self, index: int, engine: ray.actor.ActorHandle) -> None:
        self.engines[index] = engine

    def call(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        return [getattr(engine, method).remote(*args) for engine in self.engines]

    def complete(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        with self.lock:
            i = min(range(len(self.engines)), key=self.outstanding.__getitem__)
            self.outstanding[i] += 1
        try:
            return ray.get(self.engines[i].complete.remote(requests, sampling))
        finally:
            with self.lock:
                self.outstanding[i] -= 1


class AgentRolloutHost(BusProducer):
    """mode=async's rollout stage for ``rollout.agent``: a Ray actor that serves the endpoint over the run's
    rollout engines, runs the program's copies, and writes each step's episodes to the DataBus as
    :meth:`BusProducer.produce <relax_core.databus.stages.BusProducer.produce>` writes generated samples."""

    plays_episodes = True

    def __init__(self, cfg: RelaxConfig, model_path: str, engines: list, bus: DataBus, cwd: str) -> None:
        from relax_models.loader import load_tokenizer

        self.cfg, self.bus = cfg, bus
        self.engines = EngineSet(engines)
        self.program = AgentProgramRollout(cfg, self.engines, load_tokenizer(model_path), cwd)
        self.program.start()

    def generate(
        self, prompts: list[PromptRecord], greedy: bool = False, sampling: Any = None
    ) -> list[Sample]:
        """Episodes of ``prompts`` (an evaluation's ``sampling`` is the rollout's own here, as in colocate)."""
        return self.program.generate(prompts, greedy)

    def replace_engine(self, index: int, engine: ray.actor.ActorHandle) -> None:
        self.engines.replace(index, engine)

    def metrics(self) -> dict[str, float]:
        return self.program.metrics()

    def shutdown(self) -> None:
        self.program.stop()
