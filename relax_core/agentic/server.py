"""An OpenAI-compatible ``/v1/chat/completions`` endpoint over a rollout engine, recording trajectories.

An external agent program (any OpenAI client) talks to the policy under training through this server.
Each session (``X-Session-Id`` header, else the request's ``user`` field) is recorded as one token-level
trajectory: the first call's rendered conversation is the prompt; later calls append what the program
added since (tool results, user turns: loss mask 0) and the model's reply (loss mask 1, with the
sampling log-probs). The program ends the session with ``POST /v1/sessions/{id}/reward``; finished
sessions become :class:`~relax_core.samples.Sample` records (``TrajectoryStore.pop_finished``) that train
like environment episodes. When a program rewrites history so the new conversation does not extend the
recorded tokens, the trajectory restarts from the new conversation (counted in ``restarts``).
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relax_core.agentic.formatting import continuation_text, render_messages
from relax_core.engines.base import GenerationRequest, RolloutEngine, SamplingParams
from relax_core.samples import Sample, SampleStatus

FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = "relax-policy"
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = 1
    user: str | None = None


class RewardRequest(BaseModel):
    reward: float
    group_id: int | None = None


def extends(messages: list[dict[str, Any]], seen: list[dict[str, Any]]) -> bool:
    """Whether ``messages`` continue ``seen`` (same roles and contents, in order)."""

    def key(m: dict[str, Any]) -> tuple[Any, str]:
        return m.get("role"), str(m.get("content") or "")

    return len(messages) >= len(seen) and [key(m) for m in messages[: len(seen)]] == [key(m) for m in seen]


@dataclass
class Trajectory:
    session_id: str
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: int = 0
    restarts: int = 0
    # the conversation as the program will send it back: its messages plus the reply it got
    messages: list[dict[str, Any]] = field(default_factory=list)
    ended_with_eos: bool = True
    status: SampleStatus = SampleStatus.COMPLETED
    version: int = 0
    created: float = field(default_factory=time.time)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def extend_to(self, ids: list[int], eos_id: int | None) -> None:
        """Make the recorded context equal ``ids``: append the new tail (mask 0), or restart."""
        ctx = self.context
        if not self.prompt_ids:
            self.prompt_ids = list(ids)
            return
        if ids[: len(ctx)] != ctx and eos_id is not None and ids[: len(ctx) + 1] == ctx + [eos_id]:
            self._append([eos_id], None, 0)  # the model's turn was cut at the token budget, before EOS
            ctx = self.context
        if ids[: len(ctx)] == ctx:
            self._append(ids[len(ctx) :], None, 0)
        else:
            self.prompt_ids, self.response_ids, self.logprobs, self.loss_mask = list(ids), [], [], []
            self.restarts, self.turns, self.messages = self.restarts + 1, 0, []

    def _append(self, ids: list[int], logprobs: list[float] | None, mask: int) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.loss_mask += [mask] * len(ids)


class TrajectoryStore:
    """Sessions in progress and finished ones waiting for training; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live: dict[str, Trajectory] = {}
        self.finished: list[Sample] = []
        self._groups = itertools.count()

    def session(self, session_id: str) -> Trajectory:
        with self._lock:
            return self.live.setdefault(session_id, Trajectory(session_id))

    def finish(self, session_id: str, reward: float, group_id: int | None = None) -> Sample:
        """Close a session with its reward; raises KeyError for an unknown or already closed session."""
        with self._lock:
            traj = self.live.pop(session_id)
            sample = Sample(
                group_id=next(self._groups) if group_id is None else group_id,
                index_in_group=0,
                prompt_ids=traj.prompt_ids,
                response_ids=traj.response_ids,
                rollout_logprobs=traj.logprobs,
                loss_mask=traj.loss_mask,
                metadata={"session_id": session_id, "restarts": traj.restarts},
                reward=float(reward),
                reward_extras={"turns": float(traj.turns)},
                status=traj.status,
                policy_version=traj.version,
                num_turns=traj.turns,
                stop_reason="reward",
            )
            if group_id is not None:
                sample.index_in_group = sum(1 for s in self.finished if s.group_id == group_id)
            self.finished.append(sample)
            return sample

    def pop_finished(self) -> list[Sample]:
        with self._lock:
            out, self.finished = self.finished, []
            return out


def build_app(
    engine: RolloutEngine,
    tokenizer,
    sampling: SamplingParams,
    store: TrajectoryStore,
    model_name: str = "relax-policy",
    max_context_len: int | None = None,
):
    """The FastAPI app; one engine call at a time (the engine is not re-entrant)."""
    from fastapi import FastAPI, Header, HTTPException

    app = FastAPI(title="Relax policy (OpenAI-compatible)")
    engine_lock = threading.Lock()
    eos_id = tokenizer.eos_token_id

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "relax"}]}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest, x_session_id: str | None = Header(default=None)) -> dict[str, Any]:
        session_id = x_session_id or req.user
        if not session_id:
            raise HTTPException(400, "give a session id: header X-Session-Id or the request's 'user' field")
        if req.n != 1:
            raise HTTPException(400, "n must be 1: each session is one trajectory")
        if session_id in {s.metadata["session_id"] for s in store.finished}:
            raise HTTPException(409, f"session {session_id!r} already has its reward")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        traj = store.session(session_id)
        params = SamplingParams(
            max_new_tokens=req.max_completion_tokens or req.max_tokens or sampling.max_new_tokens,
            temperature=sampling.temperature if req.temperature is None else req.temperature,
            top_p=sampling.top_p if req.top_p is None else req.top_p,
            top_k=sampling.top_k,
            n=1,
        )
        with engine_lock:
            if traj.messages and extends(messages, traj.messages):
                # token-in-token-out: keep the sampled tokens, append only what the program added
                tail = continuation_text(
                    tokenizer, traj.messages[:-1], messages[len(traj.messages) :], traj.ended_with_eos
                )
                traj._append(tokenizer(tail, add_special_tokens=False).input_ids, None, 0)
            else:
                ids = tokenizer(render_messages(tokenizer, messages), add_special_tokens=False).input_ids
                traj.extend_to(ids, eos_id)
            if max_context_len is not None:
                params.max_new_tokens = min(params.max_new_tokens, max_context_len - len(traj.context))
                if params.max_new_tokens < 1:
                    raise HTTPException(
                        400, f"conversation has {len(traj.context)} tokens: no room under {max_context_len}"
                    )
            (result,) = engine.generate([GenerationRequest(traj.context, session_id)], params)
            traj._append(result.output_ids, result.logprobs, 1)
            traj.turns += 1
            traj.version = result.weight_version
            if result.finish_reason == "abort":
                traj.status = SampleStatus.ABORTED
            text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            traj.messages = [*messages, {"role": "assistant", "content": text}]
            traj.ended_with_eos = bool(result.output_ids) and result.output_ids[-1] == eos_id
            prompt_tokens = len(traj.context) - len(result.output_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop" if result.finish_reason == "stop" else "length",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(result.output_ids),
                "total_tokens": prompt_tokens + len(result.output_ids),
            },
        }

    @app.post("/v1/sessions/{session_id}/reward")
    def reward(session_id: str, req: RewardRequest) -> dict[str, Any]:
        try:
            sample = store.finish(session_id, req.reward, req.group_id)
        except KeyError:
            raise HTTPException(404, f"no open session {session_id!r}") from None
        return {"session_id": session_id, "turns": sample.num_turns, "tokens": len(sample.response_ids)}

    @app.get("/v1/sessions/{session_id}")
    def session(session_id: str) -> dict[str, Any]:
        traj = store.live.get(session_id)
        if traj is None:
            raise HTTPException(404, f"no open session {session_id!r}")
        return {
            "session_id": session_id,
            "turns": traj.turns,
            "prompt_ids": traj.prompt_ids,
            "response_ids": traj.response_ids,
            "loss_mask": traj.loss_mask,
            "restarts": traj.restarts,
        }

    return app


class AgentServer:
    """The app served by uvicorn in a background thread (``with AgentServer(...) as server: server.url``)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="relax-agent-server")
        self.url = ""

    def start(self, timeout: float = 30.0) -> AgentServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("agent server did not start")
            time.sleep(0.02)
        sock = self.server.servers[0].sockets[0]
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> AgentServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
