"""An OpenAI-compatible ``/v1/chat/completions`` endpoint over a rollout engine, recording trajectories.

An external agent program (any OpenAI client) talks to the policy under training through this server.
Each session (``X-Session-Id`` header, else the request's ``user`` field) is recorded as one token-level
trajectory: the first call's rendered conversation is the prompt; later calls append what the program
added since (tool results, user turns: loss mask 0) and the model's reply (loss mask 1, with the
sampling log-probs). The program ends the session with ``POST /v1/sessions/{id}/reward``; finished
sessions become :class:`~relax_core.samples.Sample` records (``TrajectoryStore.pop_finished``) that train
like environment episodes. When a program rewrites history so the new conversation does not extend the
recorded tokens, the trajectory restarts from the new conversation (counted in ``restarts``).

In a training run (``rollout.agent``, :mod:`relax_core.agentic.programs`) an :class:`EpisodeBoard` hands
out the step's episodes (``POST /v1/episodes/next``): only those sessions are served, with the run's
sampling settings, and each becomes one sample of its prompt's group. Concurrent calls of different
sessions are batched into one engine call (:class:`RequestBatcher`).

Function calling follows the OpenAI API: a request's ``tools`` reach the chat template, and unless
``tool_choice`` is ``"none"`` (the reply is then plain text, call blocks included) the model's call blocks
(the family's convention, :mod:`relax_core.agentic.tools`) come back as ``tool_calls`` with
``finish_reason: "tool_calls"``; the program answers with ``tool`` messages, recorded with loss mask 0 like
any message it adds. ``tool_choice: "required"`` or a named function gets a 400: sampling is not
constrained, so no call can be forced. ``stream: true``
answers with server-sent ``chat.completion.chunk`` events ending in ``data: [DONE]``; the chunks are sent
once the engine has finished the turn (the engines return whole turns).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from relax_core.agentic.formatting import continuation_text, render_messages
from relax_core.agentic.tools import message_key, parse_tool_calls
from relax_core.engines.base import GenerationRequest, GenerationResult, SamplingParams
from relax_core.resilience.health import mark_reward_error, reward_problem
from relax_core.runtime.http_auth import check_temperature, guard
from relax_core.samples import PromptRecord, Sample, SampleStatus

FINISH_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"] = "text"
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined, unset fields left out."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "".join(part.text for part in self.content)
        return out


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = "relax-policy"
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: Annotated[float | None, AfterValidator(check_temperature)] = Field(
        default=None, ge=0.0, allow_inf_nan=False
    )
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = 1
    user: str | None = None
    tools: list[Tool] | None = None
    # "auto": the model's call blocks are parsed; "none": plain text. "required" and a named function
    # are rejected (400): sampling is not constrained, so nothing could make the model call.
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class RewardRequest(BaseModel):
    # NaN/Infinity (which JSON parsers accept) get a 422 naming the field; a finite value beyond
    # reward.max_abs is accepted and scored as a reward error (TrajectoryStore.finish)
    reward: float = Field(allow_inf_nan=False)
    group_id: int | None = None
    # numbers logged as ``reward/<name>`` step metrics (e.g. accuracy, tool calls)
    metrics: dict[str, Annotated[float, Field(allow_inf_nan=False)]] = Field(default_factory=dict)


class Generates(Protocol):
    """What the endpoint samples from: a rollout engine, or the run's pool of engines."""

    def generate(
        self, requests: list[GenerationRequest], sampling: SamplingParams
    ) -> list[GenerationResult]: ...


def extends(messages: list[dict[str, Any]], seen: list[dict[str, Any]]) -> bool:
    """Whether ``messages`` continue ``seen`` (same roles, contents and tool calls, in order)."""
    return len(messages) >= len(seen) and [message_key(m) for m in messages[: len(seen)]] == [
        message_key(m) for m in seen
    ]


def sse(event: dict[str, Any] | str) -> str:
    """One server-sent event line."""
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"


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
    # a training episode (EpisodeBoard): its prompt's group, the dataset row, greedy (eval) sampling
    group_id: int | None = None
    index_in_group: int = 0
    prompt: PromptRecord | None = None
    greedy: bool = False
    # one call of a session at a time
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

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
    """Sessions in progress and finished ones waiting for training; thread-safe.

    ``open_sessions_only``: serve only sessions opened by :meth:`open` (a training run's episodes).
    """

    def __init__(self, open_sessions_only: bool = False, max_abs: float = 1e6) -> None:
        self._changed = threading.Condition()
        self.open_sessions_only = open_sessions_only
        self.max_abs = max_abs  # reward.max_abs: a reported reward beyond it is a reward error
        self.live: dict[str, Trajectory] = {}
        self.finished: list[Sample] = []
        self._groups = itertools.count()

    def session(self, session_id: str) -> Trajectory:
        """The session's trajectory; KeyError for an unknown one when only opened sessions are served."""
        with self._changed:
            if self.open_sessions_only:
                return self.live[session_id]
            return self.live.setdefault(session_id, Trajectory(session_id))

    def open(self, traj: Trajectory) -> None:
        with self._changed:
            self.live[traj.session_id] = traj

    def finish(
        self,
        session_id: str,
        reward: float,
        group_id: int | None = None,
        metrics: dict[str, float] | None = None,
    ) -> Sample:
        """Close a session with its reward; raises KeyError for an unknown or already closed session."""
        with self._changed:
            traj = self.live.pop(session_id)
            if traj.group_id is None:
                traj.group_id = next(self._groups) if group_id is None else group_id
                traj.index_in_group = sum(1 for s in self.finished if s.group_id == traj.group_id)
            extras = {"agent_failed": 0.0} | {k: float(v) for k, v in (metrics or {}).items()}
            sample = self._close(traj, float(reward), extras | {"reward_error": 0.0})
            problem = reward_problem(float(reward), self.max_abs)
            if problem is not None:
                mark_reward_error(sample, f"agent program: {problem}")
            return sample

    def fail(self, session_id: str, reason: str, keep_mask: bool = False) -> Sample | None:
        """Close a session as FAILED (reward 0; loss mask zeroed unless ``keep_mask``); None if not open."""
        with self._changed:
            traj = self.live.pop(session_id, None)
            if traj is None:
                return None
            traj.status = SampleStatus.FAILED
            if not keep_mask:
                traj.loss_mask = [0] * len(traj.loss_mask)
            return self._close(traj, 0.0, {"agent_failed": 1.0}, error=reason)

    def _close(self, traj: Trajectory, reward: float, extras: dict[str, float], error: str = "") -> Sample:
        row = traj.prompt
        metadata = dict(row.metadata) if row is not None else {}
        metadata |= {"session_id": traj.session_id, "restarts": traj.restarts}
        if error:
            metadata["agent_error"] = error
        sample = Sample(
            group_id=traj.group_id,
            index_in_group=traj.index_in_group,
            # a session that never called the model keeps the dataset prompt
            prompt_ids=traj.prompt_ids or (row.prompt_ids if row is not None else []),
            # copies: a call still running for a failed session must not change the sample
            response_ids=list(traj.response_ids),
            rollout_logprobs=list(traj.logprobs),
            loss_mask=list(traj.loss_mask),
            label=row.label if row is not None else None,
            metadata=metadata,
            reward=reward,
            reward_extras={"turns": float(traj.turns)} | extras,
            status=traj.status,
            policy_version=traj.version,
            num_turns=traj.turns,
            stop_reason="agent_error" if error else "reward",
        )
        self.finished.append(sample)
        self._changed.notify_all()
        return sample

    def pop_finished(self) -> list[Sample]:
        with self._changed:
            out, self.finished = self.finished, []
            return out

    def wait_for_change(self, timeout: float) -> None:
        """Block until a session closes or ``timeout`` seconds pass."""
        with self._changed:
            self._changed.wait(timeout)


class EpisodeBoard:
    """A training run's episodes waiting for an agent program, and which worker took which (leases).

    ``take`` blocks until an episode is posted or the board closes (the run is over: None). A worker the
    runner no longer counts as live (``is_live_worker``, e.g. one that was killed) gets None too.
    """

    def __init__(self, store: TrajectoryStore, is_live_worker: Callable[[str | None], bool]) -> None:
        self.store = store
        self.is_live_worker = is_live_worker
        self._cv = threading.Condition()
        self.pending: deque[Trajectory] = deque()
        self.leases: dict[str, tuple[str | None, float]] = {}  # session -> (worker, taken at)
        self.closed = False
        self.last_taken = time.monotonic()

    def post(self, episodes: list[Trajectory]) -> None:
        with self._cv:
            self.pending.extend(episodes)
            self.last_taken = time.monotonic()
            self._cv.notify_all()

    def take(self, worker: str | None) -> Trajectory | None:
        with self._cv:
            while not self.pending and not self.closed and self.is_live_worker(worker):
                self._cv.wait(timeout=1.0)  # a killed worker's request must not hold a server thread
            if self.closed or not self.is_live_worker(worker):
                return None
            traj = self.pending.popleft()
            self.store.open(traj)
            self.last_taken = time.monotonic()
            self.leases[traj.session_id] = (worker, self.last_taken)
            return traj

    def drain_pending(self) -> list[Trajectory]:
        """Episodes nobody took (they are failed by the caller)."""
        with self._cv:
            out, self.pending = list(self.pending), deque()
            return out

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()


# RequestBatcher with a board: seconds with no episode taken and no call queued after which the calls queued
# so far run without a session that has not made its first call (STALL_S), or without sessions between
# turns and episodes nobody takes (SETTLE_S)
SETTLE_S = 0.1
STALL_S = 2.0


@dataclass
class _Call:
    request: GenerationRequest
    sampling: SamplingParams
    done: threading.Event = field(default_factory=threading.Event)
    result: GenerationResult | None = None
    error: BaseException | None = None


class RequestBatcher:
    """Single requests from concurrent sessions -> one engine call per sampling setting.

    The engine sees one call at a time (it need not be re-entrant); the requests that arrive while a call
    runs form the next batch, so a busy endpoint batches without waiting on a timer.

    With a ``board`` (a training run) a batch is a deterministic set instead: it waits until every episode
    the board handed out and that is still open has its call queued, and none is left to take, then runs
    in session-id order. Which requests share a decode batch changes the engine's numerics (CPU matmuls
    are not batch-invariant) and which sampling draw each row gets, so batching by arrival would make a
    run's samples depend on thread timing. It waits :data:`STALL_S` at most for a session that has not
    made its first call, and :data:`SETTLE_S` for one between turns (it may be running a slow tool, have
    hung, or be done without a reward yet) or for episodes nobody takes (a program that plays fewer
    sessions at once than a round posts): those batches are not deterministic.
    """

    def __init__(self, engine: Generates, board: EpisodeBoard | None = None) -> None:
        self.engine = engine
        self.board = board
        self._cv = threading.Condition()
        self._queue: list[_Call] = []
        self._last_call = time.monotonic()
        threading.Thread(target=self._loop, daemon=True, name="relax-agent-batcher").start()

    def generate(self, request: GenerationRequest, sampling: SamplingParams) -> GenerationResult:
        call = _Call(request, sampling)
        with self._cv:
            self._queue.append(call)
            self._last_call = time.monotonic()
            self._cv.notify()
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _batch_ready(self) -> bool:
        board = self.board
        if board is None:
            return True
        idle = time.monotonic() - max(self._last_call, board.last_taken)
        queued = {c.request.request_id for c in self._queue}
        # .get: a session may close while this reads (the store's lock is not held here)
        open_ = [board.store.live.get(sid) for sid in list(board.leases) if sid not in queued]
        unqueued = [traj for traj in open_ if traj is not None]
        if any(traj.turns == 0 for traj in unqueued):  # just taken: its first call is on its way
            return idle >= STALL_S
        return not (unqueued or board.pending) or idle >= SETTLE_S

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._queue and self._batch_ready()):
                    # the board's takes and closes do not notify this condition: poll while calls wait
                    self._cv.wait(0.01 if self._queue else None)
                calls, self._queue = sorted(self._queue, key=lambda c: c.request.request_id), []
            by_sampling: dict[str, list[_Call]] = {}
            for call in calls:
                by_sampling.setdefault(repr(call.sampling), []).append(call)
            for group in by_sampling.values():
                try:
                    results = self.engine.generate([c.request for c in group], group[0].sampling)
                    for call, result in zip(group, results, strict=True):
                        call.result = result
                except Exception as err:  # noqa: BLE001  (reported to each waiting session)
                    for call in group:
                        call.error = err
                for call in group:
                    call.done.set()


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    """The decoded text of ``ids`` split where each token ends (text grows monotonically per token; a
    token that completes no character adds to the next piece)."""
    pieces, done = [], ""
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end], skip_special_tokens=True)
        if len(text) > len(done) and not text.endswith("\ufffd"):
            pieces.append(text[len(done) :])
            done = text
    return pieces


def stream_chunks(
    head: dict[str, Any],
    reply: dict[str, Any],
    pieces: list[str],
    finish: str,
    usage: dict[str, int] | None,
):
    """The turn as ``chat.completion.chunk`` events: the role, the content (per token, or whole when the
    turn made tool calls), the calls, the finish reason, the usage if asked, then ``[DONE]``."""
    chunk = head | {"object": "chat.completion.chunk"}

    def event(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        return sse(chunk | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

    yield event({"role": "assistant", "content": ""})
    for piece in pieces or ([reply["content"]] if reply["content"] else []):
        yield event({"content": piece})
    for index, call in enumerate(reply.get("tool_calls", [])):
        yield event({"tool_calls": [{"index": index, **call}]})
    yield event({}, finish)
    if usage is not None:
        yield sse(chunk | {"choices": [], "usage": usage})
    yield sse("[DONE]")


def build_app(
    engine: Generates,
    tokenizer,
    sampling: SamplingParams,
    store: TrajectoryStore,
    model_name: str = "relax-policy",
    max_context_len: int | None = None,
    board: EpisodeBoard | None = None,
):
    """The FastAPI app. A request's max_tokens can only lower ``sampling.max_new_tokens`` (the server's
    budget bounds what one call may cost). With a ``board`` (a training run) the run's ``sampling`` always
    applies: a request's temperature/top_p are ignored so the recorded log-probs are the ones training
    expects."""
    from fastapi import FastAPI, Header, HTTPException
    from fastapi.responses import StreamingResponse

    # NaN/Infinity in a body and deep nesting get a 4xx naming the cause, never a 500
    app = guard(FastAPI(title="Relax policy (OpenAI-compatible)"))
    batcher = RequestBatcher(engine, board)
    eos_id = tokenizer.eos_token_id

    def session_sampling(req: ChatRequest, traj: Trajectory) -> SamplingParams:
        asked = req.max_completion_tokens or req.max_tokens
        budget = min(asked or sampling.max_new_tokens, sampling.max_new_tokens)
        if board is not None:
            temperature = 0.0 if traj.greedy else sampling.temperature
            return dataclasses.replace(sampling, max_new_tokens=budget, temperature=temperature, n=1)
        return SamplingParams(
            max_new_tokens=budget,
            temperature=sampling.temperature if req.temperature is None else req.temperature,
            top_p=sampling.top_p if req.top_p is None else req.top_p,
            top_k=sampling.top_k,
            n=1,
        )

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "relax"}]}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest, x_session_id: str | None = Header(default=None)) -> Any:
        session_id = x_session_id or req.user
        if not session_id:
            raise HTTPException(400, "give a session id: header X-Session-Id or the request's 'user' field")
        if req.n != 1:
            raise HTTPException(400, "n must be 1: each session is one trajectory")
        if req.tool_choice not in (None, "auto", "none"):
            raise HTTPException(
                400,
                "tool_choice 'required' or a named function is not supported: sampling is not constrained, "
                "so the model cannot be forced to call; send 'auto' (the default) and check the reply's "
                "tool_calls",
            )
        if session_id in {s.metadata["session_id"] for s in store.finished}:
            raise HTTPException(409, f"session {session_id!r} already has its reward")
        try:
            traj = store.session(session_id)
        except KeyError:
            raise HTTPException(
                404, f"no open session {session_id!r}: take an episode from POST /v1/episodes/next"
            ) from None
        messages = [m.as_dict() for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
        with traj.lock:
            params = session_sampling(req, traj)
            if traj.messages and extends(messages, traj.messages):
                # token-in-token-out: keep the sampled tokens, append only what the program added
                tail = continuation_text(
                    tokenizer, traj.messages[:-1], messages[len(traj.messages) :], traj.ended_with_eos, tools
                )
                traj._append(tokenizer(tail, add_special_tokens=False).input_ids, None, 0)
            else:
                text = render_messages(tokenizer, messages, tools=tools)
                traj.extend_to(tokenizer(text, add_special_tokens=False).input_ids, eos_id)
            if max_context_len is not None:
                params.max_new_tokens = min(params.max_new_tokens, max_context_len - len(traj.context))
                if params.max_new_tokens < 1:
                    raise HTTPException(
                        400, f"conversation has {len(traj.context)} tokens: no room under {max_context_len}"
                    )
            result = batcher.generate(GenerationRequest(traj.context, session_id), params)
            traj._append(result.output_ids, result.logprobs, 1)
            traj.turns += 1
            traj.version = result.weight_version
            if result.finish_reason == "abort":
                traj.status = SampleStatus.ABORTED
            text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            content, calls = (
                (text, []) if tools is None or req.tool_choice == "none" else parse_tool_calls(text)
            )
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                reply["tool_calls"] = calls
            traj.messages = [*messages, reply]
            traj.ended_with_eos = bool(result.output_ids) and result.output_ids[-1] == eos_id
            prompt_tokens = len(traj.context) - len(result.output_ids)
        finish = "tool_calls" if calls else "stop" if result.finish_reason == "stop" else "length"
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(result.output_ids),
            "total_tokens": prompt_tokens + len(result.output_ids),
        }
        head = {
            "id": f"chatcmpl-{uuid.uuid4().hex[:16]}",
            "created": int(time.time()),
            "model": req.model or model_name,
        }
        if req.stream:
            pieces = [] if calls else token_pieces(tokenizer, result.output_ids)
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(
                stream_chunks(head, reply, pieces, finish, usage if include_usage else None),
                media_type="text/event-stream",
            )
        return head | {
            "object": "chat.completion",
            "choices": [{"index": 0, "message": reply, "finish_reason": finish}],
            "usage": usage,
        }

    @app.post("/v1/sessions/{session_id}/reward")
    def reward(session_id: str, req: RewardRequest) -> dict[str, Any]:
        try:
            sample = store.finish(session_id, req.reward, req.group_id, req.metrics)
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

    if board is not None:

        @app.post("/v1/episodes/next")
        def next_episode(worker: str | None = None) -> dict[str, Any]:
            """The next episode to play (blocks until one is posted), or ``{"done": true}`` at the end."""
            traj = board.take(worker)
            if traj is None:
                return {"done": True}
            row = traj.prompt
            return {
                "done": False,
                "session_id": traj.session_id,
                "messages": row.messages,
                "label": row.label,
                "metadata": row.metadata,
                "group_id": traj.group_id,
                "index_in_group": traj.index_in_group,
                "greedy": traj.greedy,
            }

    return app


# The handlers are plain functions, run on AnyIO's worker threads (40 by default). Every session of every
# program copy may hold one (waiting for its next episode, or for the model), and a program may run many
# sessions at once: the engine batches what waits here, so the pool must not be what limits the batch.
HANDLER_THREADS = 512


class AgentServer:
    """The app served by uvicorn in a background thread (``with AgentServer(...) as server: server.url``)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0) -> None:
        import anyio.to_thread
        import uvicorn

        class Server(uvicorn.Server):
            async def serve(self, sockets=None) -> None:
                anyio.to_thread.current_default_thread_limiter().total_tokens = HANDLER_THREADS
                await super().serve(sockets)

        self.config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self.server = Server(self.config)
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
