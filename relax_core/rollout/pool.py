"""The set of rollout engines the controller talks to, and elastic scale-out / scale-in of that set.

Members: the *launch* engines (``rollout.num_engines`` Rollout actors in the run's placement group; the
HealthManager restarts them in place, scale-in never removes them), *scaled* engines (Rollout actors added
by scale-out) and *external* engines (any SGLang-compatible server by URL, driven by a light Rollout actor
that holds the HTTP client and scores rewards). A :class:`Router` spreads a step's prompt groups over the
routable members (least outstanding samples; a group stays on one engine) and re-dispatches the groups of
an engine that fails or is force-removed, so every prompt yields exactly ``n`` samples.

Scaling requests run in a background thread through the states
``PENDING -> CREATING | CONNECTING -> HEALTH_CHECKING -> WEIGHT_SYNCING -> ACTIVE`` (or ``PARTIAL``,
``FAILED``, ``CANCELLED``; ``NOOP`` when the target is already met) for scale-out, and
``PENDING -> DRAINING -> REMOVING -> COMPLETED`` (or ``FAILED``) for scale-in. At most one request is
unfinished at a time. A new engine gets the current weights under the same lock as the training loop's
weight push, so it can never serve a stale policy.

Both modes use the pool: colocate calls :meth:`RolloutPool.generate`; async (``bus`` given) hands each
rollout round to :meth:`RolloutPool.serving` itself, counts it in flight with :meth:`RolloutPool.busy` for
scale-in to drain, and publishes through :meth:`RolloutPool.start_push` while the Actor trains.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from relax_core.engines.base import GenerationRequest, GenerationResult, SamplingParams
from relax_core.engines.router import Router
from relax_core.roles.rollout import Rollout
from relax_core.runtime import handles
from relax_core.runtime.groups import RoleGroup, SharedProcesses, actor_class
from relax_core.samples import PromptRecord, Sample, SampleStatus

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from relax_core.config.schema import RelaxConfig

log = logging.getLogger("relax")
# weight-transfer sets of elastic engines that the launch engines' channels do not reach, each an open
# channel the Actor sends into while one of them serves: external servers reload an HF folder (disk), and
# scaled engines off the reach of those channels (another node than a broadcast group's source, which
# takes no late member) read the object store
EXTERNAL = "external"
ELASTIC = "elastic"


class ScaleState(enum.StrEnum):
    PENDING = "PENDING"
    CREATING = "CREATING"
    CONNECTING = "CONNECTING"
    HEALTH_CHECKING = "HEALTH_CHECKING"
    WEIGHT_SYNCING = "WEIGHT_SYNCING"
    ACTIVE = "ACTIVE"
    PARTIAL = "PARTIAL"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    NOOP = "NOOP"
    DRAINING = "DRAINING"
    REMOVING = "REMOVING"
    COMPLETED = "COMPLETED"


TERMINAL = {
    ScaleState.ACTIVE,
    ScaleState.PARTIAL,
    ScaleState.FAILED,
    ScaleState.CANCELLED,
    ScaleState.NOOP,
    ScaleState.COMPLETED,
}


class ScaleError(Exception):
    """A scaling request that cannot be taken; ``status`` is the HTTP status the control plane answers."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class ScaleRequest:
    id: str
    kind: str  # "scale_out" | "scale_in"
    params: dict[str, Any]
    state: ScaleState = ScaleState.PENDING
    message: str = ""
    engines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    cancel_requested: bool = False

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["request_id"] = out.pop("id")
        out["status"] = str(self.state)
        out.pop("state")
        out.pop("cancel_requested")
        return out


@dataclass
class Member:
    id: str
    kind: str  # "launch" | "scaled" | "external"
    seq: int
    url: str | None = None
    handle: Any = None  # Ray actor (scaled/external); launch members read the RoleGroup slot
    index: int = -1  # launch: replica index in the RoleGroup
    inflight: int = 0
    forced_out: bool = False
    # the weight-transfer set whose channel brings it each version (elastic members; set when it joins)
    channel: str = "policy"


class RolloutPool(RoleGroup):
    """Launch engines (a :class:`RoleGroup`, so the HealthManager watches them) plus elastic members."""

    def __init__(
        self,
        cfg: RelaxConfig,
        model_path: str,
        pg: PlacementGroup,
        bundles: list[int],
        shared: SharedProcesses | None = None,
        bus: Any = None,
    ) -> None:
        """``shared``: the launch engines live in these processes (colocate: the Actor's); ``bus``: every
        engine, scaled ones included, writes its samples to this DataBus (mode=async)."""
        r = cfg.rollout
        super().__init__(
            Rollout,
            "rollout",
            r.num_engines,
            pg,
            bundles,
            r.num_cpus,
            r.num_gpus,
            (cfg, model_path),
            pass_replica=True,
            kwargs={"bus": bus} if bus is not None else None,
            shared=shared,
            # in one process, engines that write to a bus produce while the other roles train
            threaded=bus is not None,
        )
        self.cfg = cfg
        self.bus = bus
        self.model_path = model_path
        self._in_process = pg is None  # cluster=in_process: no Ray, no nodes
        self.router = Router()
        self.lock = threading.RLock()  # membership
        self.weights_lock = threading.Lock()  # weight pushes and new-engine syncs never interleave
        self._seq = itertools.count()
        self.members: dict[str, Member] = {}
        self._version: int | None = None
        self._wanted: set[str] = set()  # open channels a joining engine waits for: the next publish sends
        self.transfer = None  # attach()
        self.requests: dict[str, ScaleRequest] = {}
        self.last_generate: dict[str, float] = {}
        for i in range(r.num_engines):
            self._add(Member(f"launch-{i}", "launch", next(self._seq), index=i))
        self._stop = threading.Event()
        self._health_thread = threading.Thread(target=self._health_loop, name="rollout-health", daemon=True)
        self._health_thread.start()
        for url in r.engine_urls:  # external engines named at launch join synchronously
            req = self.scale_out(engine_urls=[url], background=False)
            if req.state not in (ScaleState.ACTIVE, ScaleState.NOOP):
                raise RuntimeError(f"external engine {url} could not join: {req.errors or req.message}")

    # ------------------------------------------------------------------ membership
    def _add(self, member: Member) -> None:
        with self.lock:
            self.members[member.id] = member
            self.router.add(member.id)

    def handle(self, member: Member) -> Any:
        return self.actors[member.index] if member.kind == "launch" else member.handle

    def _node_ips(self, members: list[Member]) -> list[str | None]:
        """The node address each member's engine runs on (None: unknown, or an external server's URL says)."""
        if self._in_process:
            return [None] * len(members)
        refs = [None if m.kind == "external" else self.handle(m).node_address.remote() for m in members]
        ips: list[str | None] = []
        for ref in refs:
            try:
                ips.append(None if ref is None else handles.get(ref, timeout=10)[1])
            except Exception:  # a dead or unreachable engine: its node is unknown
                ips.append(None)
        return ips

    def engines(self) -> list[dict[str, Any]]:
        """What ``GET /rollout/engines`` shows."""
        with self.lock:
            members = list(self.members.values())
        nodes = self._node_ips(members)
        with self.lock:
            out = []
            for m, node in zip(members, nodes, strict=True):
                state = self.router.state(m.id)
                out.append(
                    {
                        "id": m.id,
                        "kind": m.kind,
                        "url": m.url,
                        "node": node,
                        "healthy": bool(state and state.healthy),
                        "draining": bool(state and state.draining),
                        "inflight_prompts": m.inflight,
                        "weight_version": self._version,
                    }
                )
            return out

    def num_active(self) -> int:
        with self.lock:
            return sum(1 for m in self.members.values() if not self.router.state(m.id).draining)

    def _health_loop(self) -> None:
        interval = max(self.cfg.rollout.health_check_interval_s, 0.2)
        while not self._stop.wait(interval):
            try:
                self.check_health()
            except Exception as err:  # never take the run down from the watcher
                log.debug("rollout health round failed: %s", err)

    def _probe(self, key: str, timeout: float = 30.0) -> bool:
        member = self.members.get(key)
        if member is None:
            return False
        return bool(handles.get(self.handle(member).health.remote(), timeout=timeout))

    def check_health(self) -> dict[str, bool]:
        """Probe every member: failing ones stop being routed to, recovered ones are routed to again."""
        return self.router.check_health(self._probe, drop_after=2)

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompts: list[PromptRecord], greedy: bool = False, sampling: SamplingParams | None = None
    ) -> list[Sample]:
        """Scored samples of every prompt (``n`` each, or ``sampling.n`` for an evaluation's sampling),
        prompt order kept, across the routable engines."""
        n = sampling.n if sampling is not None else 1 if greedy else self.cfg.rollout.n_samples_per_prompt
        results: dict[int, list[Sample]] = {}
        todo = list(range(len(prompts)))
        last_error: BaseException | None = None
        used: set[str] = set()
        for _attempt in range(8):
            if not todo:
                break
            if not self.router.keys(routable_only=True):
                self.check_health()  # e.g. a launch engine the HealthManager just restarted
            try:
                keys = self.router.assign([n] * len(todo))
            except RuntimeError as no_engine:
                if last_error is not None:
                    raise last_error from no_engine
                raise
            chunks: dict[str, list[int]] = {}
            for pi, key in zip(todo, keys):
                chunks.setdefault(key, []).append(pi)
            refs = {}
            with self.lock:
                for key, idxs in chunks.items():
                    member = self.members[key]
                    member.inflight += len(idxs)
                    used.add(key)
                    ref = self.handle(member).generate.remote([prompts[i] for i in idxs], greedy, sampling)
                    refs[ref] = (member, idxs)
            todo = []
            while refs:
                ready, _ = handles.wait(list(refs), num_returns=1)
                for ref in ready:
                    member, idxs = refs.pop(ref)
                    self.router.release(member.id, n * len(idxs))
                    with self.lock:
                        member.inflight -= len(idxs)
                    try:
                        out = handles.get(ref)
                    except Exception as err:  # engine died or its server failed: route elsewhere
                        log.warning(
                            "rollout engine %s failed (%s); re-routing %d prompts", member.id, err, len(idxs)
                        )
                        last_error = err
                        self.router.mark_unhealthy(member.id)
                        todo += idxs
                        continue
                    self.router.mark_healthy(member.id)  # it just served
                    if member.forced_out and any(s.status == SampleStatus.ABORTED for s in out):
                        todo += idxs  # force-removed mid-generation: regenerate elsewhere
                        continue
                    if len(out) == n * len(idxs):
                        for j, i in enumerate(idxs):
                            results[i] = out[j * n : (j + 1) * n]
                    else:  # e.g. multi-turn episodes: keep them together under the first prompt
                        results[idxs[0]] = out
                        for i in idxs[1:]:
                            results[i] = []
        if todo:
            raise RuntimeError(f"{len(todo)} prompts found no working rollout engine") from last_error
        samples = [s for i in range(len(prompts)) for s in results[i]]
        self.last_generate = {
            "rollout/num_samples": float(len(samples)),
            "rollout/unique_samples": float(len({(s.group_id, s.index_in_group) for s in samples})),
            "rollout/num_engines": float(self.num_active()),
            "rollout/engines_used": float(len(used)),
        }
        return samples

    def complete(self, requests: list[GenerationRequest], sampling: SamplingParams) -> list[GenerationResult]:
        """Raw continuations of token-level requests (the agent endpoint), spread over the routable
        engines; the requests of an engine that fails go to the others."""
        results: list[GenerationResult | None] = [None] * len(requests)
        todo, last_error = list(range(len(requests))), None
        for _attempt in range(8):
            if not todo:
                break
            if not self.router.keys(routable_only=True):
                self.check_health()
            chunks: dict[str, list[int]] = {}
            for i, key in zip(todo, self.router.assign([1] * len(todo))):
                chunks.setdefault(key, []).append(i)
            refs = {}
            with self.lock:  # counted in flight: a scale-in drains them before removing the engine
                for key, idxs in chunks.items():
                    member = self.members[key]
                    member.inflight += len(idxs)
                    refs[key] = (
                        member,
                        self.handle(member).complete.remote([requests[i] for i in idxs], sampling),
                    )
            todo = []
            for key, (member, ref) in refs.items():
                try:
                    out = handles.get(ref)
                except Exception as err:  # engine died or its server failed: route elsewhere
                    log.warning(
                        "rollout engine %s failed (%s); re-routing %d requests", key, err, len(chunks[key])
                    )
                    last_error = err
                    self.router.mark_unhealthy(key)
                    todo += chunks[key]
                    continue
                finally:
                    self.router.release(key, len(chunks[key]))
                    with self.lock:
                        member.inflight -= len(chunks[key])
                for i, result in zip(chunks[key], out, strict=True):
                    results[i] = result
        if todo:
            raise RuntimeError(f"{len(todo)} requests found no working rollout engine") from last_error
        return results

    def step_metrics(self) -> dict[str, float]:
        """Sample counts and engine counts of the latest :meth:`generate` (merged into step metrics)."""
        return dict(self.last_generate)

    # ------------------------------------------------------------------ weights
    def attach(self, transfer) -> None:
        """The run's :class:`~relax_core.weight_transfer.WeightTransfer`; its ``policy`` set is the launch
        engines. An elastic engine reads the channel of the last publish that reaches it (``deliver``), else
        an open channel of its own kind: the Actor writes an HF folder for external servers (``external``)
        and puts the weights in the object store for scaled engines nothing else reaches (``elastic``)."""
        self.transfer = transfer
        transfer.open_channel(EXTERNAL, "disk")
        transfer.open_channel(ELASTIC, "object_store")

    def _channel(self, member: Member) -> str:
        """The weight-transfer set a joining member reads each version from."""
        if member.kind == "external":
            return EXTERNAL
        return "policy" if self.transfer.reaches(member.handle) else ELASTIC

    def _sync_refs(self, members: list[Member]) -> list[tuple[Member, Any]]:
        """Bring elastic ``members`` to the newest published version; one whose open channel that publish
        did not send into is left out (see :meth:`_await_publish`)."""
        refs = []
        for m in members:
            ref = self.transfer.deliver(m.handle, name=m.channel)
            if ref is not None:
                refs.append((m, ref))
        return refs

    def _await_publish(self, channels: set[str], deadline: float) -> None:
        """Members join that read open ``channels`` the newest publish did not send into (none of their kind
        served then): ask the next publishes for them (until the caller clears ``_wanted``) and return once
        one started; the caller then takes ``weights_lock``, which that publish holds until it is done."""
        self._wanted = set(channels)
        published = self._version
        while self._version == published and time.monotonic() < deadline:
            time.sleep(0.05)

    def start_push(
        self, version: int, names: tuple[str, ...] = ("policy",)
    ) -> tuple[list[Any], list[tuple[Member, Any]]]:
        """Start publishing ``version`` to the transfer's sets ``names`` and to every elastic member; returns
        (the sets' refs, (member, ref) per elastic member). The caller holds ``weights_lock`` until all
        finished, so a joining engine reads a finished version (mode=async overlaps this with training)."""
        self._version = version
        with self.lock:
            members = [m for m in self.members.values() if m.kind != "launch"]
        names = (*names, *sorted(self._wanted | {m.channel for m in members} - {"policy", *names}))
        refs = self.transfer.publish_refs(version, names)
        return refs, self._sync_refs(members)

    def member_failed(self, member: Member, what: str = "weight push") -> None:
        """An elastic member failed ``what`` (e.g. loading a pushed version): it is not routed to until healthy."""
        log.warning("%s on %s failed; it stops serving until healthy", what, member.id)
        self.router.mark_unhealthy(member.id)

    def push_weights(self, version: int) -> None:
        """Publish ``version`` to every member; engines that join later get it too."""
        with self.weights_lock:
            t = time.perf_counter()
            refs, elastic = self.start_push(version)
            handles.get(refs)  # launch engines: a failure goes to the HealthManager
            for member, ref in elastic:
                try:
                    handles.get(ref)
                except Exception:
                    self.member_failed(member)
            self.transfer.finished(version, time.perf_counter() - t)

    def serving(self) -> list[Member]:
        """Members a mode that drives the engines itself (async) hands rollout work to, in join order: the
        launch engines always (the HealthManager keeps them), elastic ones while routable."""
        with self.lock:
            members = sorted(self.members.values(), key=lambda m: m.seq)
            return [m for m in members if m.kind == "launch" or self.router.state(m.id).routable]

    def busy(self, member: Member, prompts: int) -> None:
        """``prompts`` more (or, negative, fewer) of ``member``'s prompts in flight: scale-in drains them."""
        with self.lock:
            member.inflight += prompts

    def release_memory(self) -> None:
        """Every engine frees its generation memory (KV cache) while the trainer steps (colocate)."""
        self._every_member("release_memory")

    def resume_memory(self) -> None:
        """Every engine takes back what :meth:`release_memory` freed."""
        self._every_member("resume_memory")

    def _every_member(self, method: str) -> None:
        with self.lock:
            members = list(self.members.values())
        refs = [(m, getattr(self.handle(m), method).remote()) for m in members]
        for member, ref in refs:
            try:
                handles.get(ref)
            except Exception:
                if member.kind == "launch":  # the HealthManager's to handle
                    raise
                self.member_failed(member, method)

    # ------------------------------------------------------------------ scale-out
    def _busy(self) -> ScaleRequest | None:
        return next((q for q in self.requests.values() if not q.finished), None)

    def _new_request(self, kind: str, params: dict[str, Any]) -> ScaleRequest:
        busy = self._busy()
        if busy is not None:
            raise ScaleError(409, f"{busy.kind} request {busy.id} is still {busy.state}; wait or cancel it")
        req = ScaleRequest(uuid.uuid4().hex[:12], kind, params)
        self.requests[req.id] = req
        return req

    def _set(self, req: ScaleRequest, state: ScaleState, message: str = "") -> None:
        req.state, req.updated_at = state, time.time()
        if message:
            req.message = message
        log.info("rollout %s %s: %s %s", req.kind, req.id, state, message)

    def scale_out(
        self,
        num_replicas: int | None = None,
        engine_urls: list[str] | None = None,
        timeout_secs: float | None = None,
        background: bool = True,
    ) -> ScaleRequest:
        """Start a scale-out to ``num_replicas`` engines in all, or join the external ``engine_urls``."""
        if (num_replicas is None) == (not engine_urls):
            raise ScaleError(400, "give exactly one of num_replicas (a target count) or engine_urls")
        limit = self.cfg.rollout.max_engines
        with self.lock:
            current = self.num_active()
            known = {m.url for m in self.members.values() if m.url}
            if num_replicas is not None and num_replicas > limit:
                raise ScaleError(400, f"num_replicas={num_replicas} exceeds rollout.max_engines={limit}")
            new_urls = [u.rstrip("/") for u in engine_urls or [] if u.rstrip("/") not in known]
            if engine_urls and current + len(set(new_urls)) > limit:
                raise ScaleError(400, f"joining {len(new_urls)} engines exceeds rollout.max_engines={limit}")
            params = {"num_replicas": num_replicas, "engine_urls": engine_urls, "timeout_secs": timeout_secs}
            req = self._new_request("scale_out", params)
            if (num_replicas is not None and num_replicas <= current) or (engine_urls and not new_urls):
                what = (
                    f"{current} engines already serve"
                    if num_replicas is not None
                    else "every URL is registered"
                )
                self._set(req, ScaleState.NOOP, what)
                return req
            req.params["new_urls"] = list(dict.fromkeys(new_urls))
            req.params["add"] = (
                (num_replicas - current) if num_replicas is not None else len(req.params["new_urls"])
            )
        timeout = timeout_secs or self.cfg.control_plane.scale_out_timeout_s
        if background:
            threading.Thread(target=self._run_scale_out, args=(req, timeout), daemon=True).start()
        else:
            self._run_scale_out(req, timeout)
        return req

    def _spawn_member(self, url: str | None) -> Member:
        r, seq = self.cfg.rollout, next(self._seq)
        kind = "external" if url else "scaled"
        import ray  # here only: cluster=in_process runs where Ray is not installed

        cls = ray.remote(actor_class(Rollout)).options(
            name=f"rollout-{kind}-{seq}-{uuid.uuid4().hex[:6]}",
            num_cpus=0.05 if url else r.num_cpus,
            num_gpus=0 if url else r.num_gpus,
            max_concurrency=2,
        )
        bus = {"bus": self.bus} if self.bus is not None else {}
        handle = cls.remote(self.cfg, self.model_path, replica=1000 + seq, engine_url=url, **bus)
        return Member(f"{kind}-{seq}", kind, seq, url=url, handle=handle)

    def _run_scale_out(self, req: ScaleRequest, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        created: list[Member] = []
        try:
            urls = req.params["new_urls"]
            self._set(req, ScaleState.CONNECTING if urls else ScaleState.CREATING)
            created = [self._spawn_member(u) for u in urls] or [
                self._spawn_member(None) for _ in range(req.params["add"])
            ]
            pending = {m.handle.__ray_ready__.remote(): m for m in created}
            ready_members, failed = [], []
            while pending and not req.cancel_requested and time.monotonic() < deadline:
                done, _ = handles.wait(list(pending), num_returns=1, timeout=0.2)
                for ref in done:
                    m = pending.pop(ref)
                    try:
                        handles.get(ref)
                        ready_members.append(m)
                    except Exception as err:
                        failed.append(m)
                        req.errors.append(f"{m.url or m.id}: {err}")
            if req.cancel_requested:  # the engines may still be loading: no graceful shutdown to wait for
                self._kill(created, graceful=False)
                self._set(req, ScaleState.CANCELLED, "cancelled; created engines removed")
                return
            for m in pending.values():
                failed.append(m)
                req.errors.append(f"{m.url or m.id}: not started within {timeout:.0f}s")
            self._set(req, ScaleState.HEALTH_CHECKING)
            healthy = []
            for m in ready_members:
                try:
                    left = max(deadline - time.monotonic(), 1.0)
                    if handles.get(m.handle.health.remote(), timeout=left):
                        healthy.append(m)
                        continue
                    req.errors.append(f"{m.url or m.id}: health check failed")
                except Exception as err:
                    req.errors.append(f"{m.url or m.id}: health check failed: {err}")
                failed.append(m)
            self._set(req, ScaleState.WEIGHT_SYNCING)
            for m in healthy:
                m.channel = self._channel(m)
                log.info(
                    "rollout %s takes each version through the weight transfer's %r set", m.id, m.channel
                )
            unsent = {m.channel for m in healthy} - {"policy"}
            unsent = {c for c in unsent if not self.transfer.published_into(c)}
            if unsent and self._version is not None:
                self._await_publish(unsent, deadline)
            with self.weights_lock:  # no training push can slip between this sync and activation
                self._wanted = set()
                synced = []
                if self._version is not None:
                    refs = self._sync_refs(healthy)
                    served = {id(m) for m, _ in refs}
                    for m in healthy:
                        if id(m) not in served:
                            req.errors.append(f"{m.url}: no weights were published within {timeout:.0f}s")
                            failed.append(m)
                    for m, ref in refs:
                        try:
                            handles.get(ref)
                            synced.append(m)
                        except Exception as err:
                            req.errors.append(f"{m.url or m.id}: weight sync failed: {err}")
                            failed.append(m)
                else:
                    synced = healthy  # no push yet: every engine serves the initial weights
                for m in synced:
                    self._add(m)
                    req.engines.append(m.id)
            self._kill(failed)
            if synced and not failed:
                self._set(
                    req, ScaleState.ACTIVE, f"{len(synced)} engines joined; {self.num_active()} serving"
                )
            elif synced:
                self._set(req, ScaleState.PARTIAL, f"{len(synced)} joined, {len(failed)} failed")
            else:
                self._set(req, ScaleState.FAILED, "no engine joined")
        except Exception as err:  # the request fails, the run goes on
            log.exception("scale-out %s failed", req.id)
            req.errors.append(str(err))
            self._kill([m for m in created if m.id not in self.members])
            self._set(req, ScaleState.FAILED, str(err))

    def cancel(self, request_id: str) -> ScaleRequest:
        req = self.get_request(request_id, "scale_out")
        if req.state not in (ScaleState.PENDING, ScaleState.CREATING, ScaleState.CONNECTING):
            raise ScaleError(
                409, f"scale-out {request_id} is {req.state}: only PENDING/CREATING can be cancelled"
            )
        req.cancel_requested = True
        deadline = time.monotonic() + 60
        while not req.finished and time.monotonic() < deadline:
            time.sleep(0.05)
        return req

    def _kill(self, members: list[Member], graceful: bool = True) -> None:
        for m in members:
            try:
                if graceful:
                    handles.get(m.handle.shutdown.remote(), timeout=10)
            except Exception:
                pass
            try:
                handles.kill(m.handle)
            except Exception:
                pass

    # ------------------------------------------------------------------ scale-in
    def scale_in(
        self,
        num_replicas: int | None = None,
        engine_urls: list[str] | None = None,
        force: bool = False,
        dry_run: bool = False,
        timeout_secs: float | None = None,
    ) -> ScaleRequest | dict[str, Any]:
        """Remove engines, newest first (or the named external ones), draining their in-flight work."""
        if (num_replicas is None) == (not engine_urls):
            raise ScaleError(400, "give exactly one of num_replicas (a target count) or engine_urls")
        with self.lock:
            launch = sum(1 for m in self.members.values() if m.kind == "launch")
            active = [m for m in self.members.values() if not self.router.state(m.id).draining]
            if num_replicas is not None:
                if num_replicas < launch:
                    raise ScaleError(
                        400,
                        f"num_replicas={num_replicas} is below the {launch} launch engines, which are protected",
                    )
                removable = sorted((m for m in active if m.kind != "launch"), key=lambda m: -m.seq)
                victims = removable[: max(len(active) - num_replicas, 0)]
            else:
                by_url = {m.url: m for m in active if m.url}
                wanted = [u.rstrip("/") for u in engine_urls or []]
                unknown = [u for u in wanted if u not in by_url]
                if unknown:
                    raise ScaleError(400, f"not registered engine URLs: {unknown}")
                victims = [by_url[u] for u in dict.fromkeys(wanted)]
            plan = [m.id for m in victims]
            if dry_run:
                return {
                    "dry_run": True,
                    "engines": plan,
                    "remaining": len(active) - len(plan),
                    "force": force,
                }
            req = self._new_request(
                "scale_in", {"num_replicas": num_replicas, "engine_urls": engine_urls, "force": force}
            )
            req.engines = plan
            if not victims:
                self._set(req, ScaleState.NOOP, f"{len(active)} engines serve; nothing to remove")
                return req
            for m in victims:
                self.router.set_draining(m.id)
        timeout = timeout_secs if timeout_secs is not None else self.cfg.rollout.drain_timeout_s
        threading.Thread(target=self._run_scale_in, args=(req, victims, force, timeout), daemon=True).start()
        return req

    def _run_scale_in(self, req: ScaleRequest, victims: list[Member], force: bool, timeout: float) -> None:
        try:
            # mode=async: an engine's round writes rows to the bus as it goes, so it is never aborted (its
            # rows would be cut short); it takes no new round and the scale-in waits for the one it runs
            abortable = self.bus is None
            forced = force and abortable
            self._set(req, ScaleState.DRAINING, "forced: aborting in-flight work" if forced else "")
            if forced:
                for m in victims:
                    m.forced_out = True
                    m.handle.abort.remote()
            deadline = time.monotonic() + timeout if abortable else float("inf")
            while any(m.inflight for m in victims) and time.monotonic() < deadline:
                time.sleep(0.05)
            if any(m.inflight for m in victims):  # drain timed out: abort; generate() re-routes the prompts
                for m in victims:
                    m.forced_out = True
                    m.handle.abort.remote()
                while any(m.inflight for m in victims) and time.monotonic() < deadline + 30:
                    time.sleep(0.05)
            self._set(req, ScaleState.REMOVING)
            with self.lock:
                for m in victims:
                    self.members.pop(m.id, None)
                    self.router.remove(m.id)
            self._kill(victims)
            self._set(req, ScaleState.COMPLETED, f"removed {len(victims)}; {self.num_active()} serving")
        except Exception as err:
            log.exception("scale-in %s failed", req.id)
            self._set(req, ScaleState.FAILED, str(err))

    # ------------------------------------------------------------------ queries and teardown
    def get_request(self, request_id: str, kind: str) -> ScaleRequest:
        req = self.requests.get(request_id)
        if req is None or req.kind != kind:
            raise ScaleError(404, f"no {kind} request {request_id!r}")
        return req

    def list_requests(self, kind: str) -> list[dict[str, Any]]:
        return [q.to_dict() for q in self.requests.values() if q.kind == kind]

    def kill(self) -> None:
        self._stop.set()
        with self.lock:
            extra = [m for m in self.members.values() if m.kind != "launch"]
            self.members = {k: m for k, m in self.members.items() if m.kind == "launch"}
        for m in extra:
            try:
                handles.kill(m.handle)
            except Exception:
                pass
        super().kill()
