"""The OpenAI-compatible endpoint: a real uvicorn server, a real HTTP client driving a small agent loop
(model turn -> tool result -> model turn -> reward), trajectories recorded with masks and trained on."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from relax_core.agentic.formatting import render_messages
from relax_core.agentic.server import (
    AgentServer,
    EpisodeBoard,
    RequestBatcher,
    Trajectory,
    TrajectoryStore,
    build_app,
)
from relax_core.engines.base import GenerationRequest, GenerationResult, SamplingParams
from relax_core.samples import TrainBatch


@pytest.fixture
def server(engine, tokenizer):
    store = TrajectoryStore()
    app = build_app(engine, tokenizer, SamplingParams(max_new_tokens=6), store, max_context_len=200)
    with AgentServer(app) as srv:
        srv.store = store
        yield srv


def agent_episode(client: httpx.Client, session: str, question: str, group: int) -> dict:
    """A tiny external agent: ask, feed a tool result back, ask again, report a reward."""
    messages = [{"role": "user", "content": question}]
    transcript = []
    for turn in range(2):
        reply = client.post(
            "/v1/chat/completions",
            json={"model": "relax-policy", "messages": messages, "max_tokens": 5},
            headers={"X-Session-Id": session},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        content = body["choices"][0]["message"]["content"]
        transcript.append(content)
        messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": f"=r{turn}"}]
    reward = float(len(transcript[-1]) % 2)
    r = client.post(f"/v1/sessions/{session}/reward", json={"reward": reward, "group_id": group})
    assert r.status_code == 200, r.text
    return {"reward": reward, "transcript": transcript, "reply": r.json()}


def test_agent_loop_over_http_records_masked_trajectories(server, tokenizer, tiny_path):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "relax-policy"
        results = [agent_episode(client, f"s{i}", "12+34", group=0) for i in range(4)]
        # the `user` field also names a session
        reply = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "user": "u1"}
        )
        assert reply.status_code == 200
        live = client.get("/v1/sessions/u1").json()
        assert live["turns"] == 1 and live["loss_mask"] == [1] * len(live["response_ids"])
        # bad requests get one clear error each
        assert (
            client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            ).status_code
            == 400
        )
        assert (
            client.post(
                "/v1/chat/completions", json={"messages": []}, headers={"X-Session-Id": "z"}
            ).status_code
            == 422
        )
        assert client.post("/v1/sessions/nope/reward", json={"reward": 1.0}).status_code == 404
        assert client.post("/v1/sessions/s0/reward", json={"reward": 1.0}).status_code == 404

    samples = server.store.pop_finished()
    assert len(samples) == 4 and server.store.pop_finished() == []
    eos = tokenizer.eos_token
    for s, res in zip(samples, results):
        assert s.num_turns == 2 and s.reward == res["reward"] and s.group_id == 0
        assert s.metadata["restarts"] == 0, "each call extended the recorded conversation"
        assert tokenizer.decode(s.prompt_ids) == "12+34\n"
        # layout: turn 1 (mask 1), the tool result the program added (mask 0), turn 2 (mask 1)
        runs = []
        for tok, m in zip(s.response_ids, s.loss_mask):
            if runs and runs[-1][0] == m:
                runs[-1][1].append(tok)
            else:
                runs.append((m, [tok]))
        assert [m for m, _ in runs] == [1, 0, 1]
        assert tokenizer.decode(runs[1][1]).endswith("=r0\n")
        first = tokenizer.decode(runs[0][1], skip_special_tokens=True)
        assert first == res["transcript"][0]
        lp = torch.tensor(s.rollout_logprobs)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        assert (lp[mask] < 0).all() and (lp[~mask] == 0).all()
        if not tokenizer.decode(runs[0][1]).endswith(
            eos
        ):  # a turn cut at max_tokens gets EOS from the template
            assert tokenizer.decode(runs[1][1]).startswith(eos)
    assert [s.index_in_group for s in samples] == [0, 1, 2, 3]

    # the recorded trajectories train like environment episodes: one real Actor step
    from relax_core.config.schema import RelaxConfig
    from relax_core.roles.actor import Actor

    cfg = RelaxConfig()
    cfg.algorithm.entropy_coef = 0.0
    actor = Actor(cfg, tiny_path)
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    from relax_core.algorithms import ADVANTAGE_ESTIMATORS

    batch.extras["advantages"] = ADVANTAGE_ESTIMATORS.get("grpo")(
        batch.rewards, batch.group_ids, batch.loss_mask
    )
    before = {k: v.clone() for k, v in actor.state_dict().items()}
    metrics = actor.train(1, batch)
    assert metrics["optimizer_steps"] == 1.0
    if batch.rewards.std() > 0:
        assert any(not torch.equal(before[k], v) for k, v in actor.state_dict().items())


def test_rewritten_history_restarts_the_trajectory(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        head = {"X-Session-Id": "r"}
        client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}]}, headers=head
        )
        client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "zz"}]}, headers=head
        )
        state = client.get("/v1/sessions/r").json()
    assert state["restarts"] == 1 and state["turns"] == 1
    assert state["loss_mask"] == [1] * len(state["response_ids"])


def test_plain_rendering_matches_how_the_model_ends_turns(tokenizer):
    text = render_messages(
        tokenizer,
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a"},
            {"role": "tool", "content": "t"},
        ],
    )
    assert text == "q\na<eos>t\n"


def test_agent_endpoint_rejects_non_finite_rewards_and_counts_out_of_range_ones(engine, tokenizer):
    store = TrajectoryStore(max_abs=100.0)
    app = build_app(engine, tokenizer, SamplingParams(max_new_tokens=2), store)
    with AgentServer(app) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        for sid in ("a", "b", "c"):
            chat = {"messages": [{"role": "user", "content": "1+1"}], "user": sid}
            assert client.post("/v1/chat/completions", json=chat).status_code == 200
        for body in ('{"reward": NaN}', '{"reward": Infinity}', '{"reward": 1, "metrics": {"x": -Infinity}}'):
            r = client.post(
                "/v1/sessions/a/reward", content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == 422 and ("reward" in r.text or "metrics" in r.text), r.text
        assert client.post("/v1/sessions/b/reward", json={"reward": 1e39}).status_code == 200
        assert client.post("/v1/sessions/c/reward", json={"reward": 0.5}).status_code == 200
    done = {s.metadata["session_id"]: s for s in store.finished}
    assert set(done) == {"b", "c"}  # "a" stays open: its reports were refused
    assert done["b"].reward == 0.0 and done["b"].reward_extras["reward_error"] == 1.0
    assert "reward.max_abs=100" in done["b"].metadata["reward_error"]
    assert done["c"].reward == 0.5 and done["c"].reward_extras["reward_error"] == 0.0


class CountingBoard(EpisodeBoard):
    """An episode board that counts the requests waiting in it."""

    def __init__(self, store: TrajectoryStore) -> None:
        super().__init__(store, is_live_worker=lambda worker: True)
        self.waiting = 0
        self._count = threading.Lock()

    def take(self, worker):
        with self._count:
            self.waiting += 1
        return super().take(worker)


def test_a_model_call_is_served_while_many_sessions_wait_for_episodes(engine, tokenizer):
    """A program may play many sessions at once: 100 of them waiting for their next episode (each waiting
    request holds one of the endpoint's handler threads) leave room for another session's model call; the
    board's close answers every one of them."""
    store = TrajectoryStore()
    board = CountingBoard(store)
    app = build_app(engine, tokenizer, SamplingParams(max_new_tokens=2), store, board=board)
    with AgentServer(app) as srv, ThreadPoolExecutor(100) as pool:
        waiters = [pool.submit(httpx.post, f"{srv.url}/v1/episodes/next", timeout=120) for _ in range(100)]
        deadline = time.monotonic() + 120
        while board.waiting < 100 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert board.waiting == 100
        chat = {"messages": [{"role": "user", "content": "1+1"}], "user": "busy"}
        reply = httpx.post(f"{srv.url}/v1/chat/completions", json=chat, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"] == "assistant"
        assert not any(w.done() for w in waiters)  # still waiting: the call did not wait for them
        board.close()
        assert [w.result().json() for w in waiters] == [{"done": True}] * 100


class RecordingEngine:
    """Answers every request with one token and records each engine call's request ids."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def generate(self, requests, sampling):
        self.calls.append([r.request_id for r in requests])
        return [GenerationResult([1], [0.0], "stop", r.request_id) for r in requests]


def test_a_training_endpoint_batches_every_open_episode_in_session_order():
    """Calls that arrive one by one run as one batch once every handed-out episode has called, in session-id
    order (what makes a seed replay the same run); episodes nobody takes hold it back only SETTLE_S."""
    store = TrajectoryStore(open_sessions_only=True)
    board = EpisodeBoard(store, is_live_worker=lambda worker: True)
    engine = RecordingEngine()
    batcher = RequestBatcher(engine, board)
    board.post([Trajectory(f"s{i}") for i in range(3)])
    taken = [board.take(None).session_id for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        for sid in reversed(taken):
            pool.submit(batcher.generate, GenerationRequest([1], sid), SamplingParams())
            time.sleep(0.3)  # longer than SETTLE_S: only the open sessions' calls complete the batch
    assert engine.calls == [["s0", "s1", "s2"]]
    board.post([Trajectory(f"t{i}") for i in range(4)])
    taken = [board.take(None).session_id for _ in range(2)]  # a program that plays two at a time
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda sid: batcher.generate(GenerationRequest([1], sid), SamplingParams()), taken))
    assert engine.calls[1:] == [["t0", "t1"]]
