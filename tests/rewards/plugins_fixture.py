"""Custom rewards used by the executor tests, loaded by file path (works in worker processes too)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import time
from typing import Any

from relax_rewards import group_reward, register

Metadata = dict[str, Any] | None


def sleepy_reward(response: str, label: Any, metadata: Metadata = None) -> float:
    """Hangs for 30 s when asked to (then touches the file ``metadata["woke"]``, if given: a caller that
    waited for the hung call finds it), else scores an exact match."""
    md = metadata or {}
    if md.get("hang"):
        time.sleep(30)
        if md.get("woke"):
            open(md["woke"], "w").close()
    return 1.0 if response.strip() == str(label) else 0.0


def boom_reward(response: str, label: Any, metadata: Metadata = None) -> float:
    if (metadata or {}).get("boom"):
        raise ValueError(f"cannot grade {response!r}")
    return 1.0 if response.strip() == str(label) else 0.0


def logged_sleepy_reward(response: str, label: Any, metadata: Metadata = None) -> float:
    """``sleepy_reward`` that first appends its start time to the file ``metadata["log"]``."""
    with open((metadata or {})["log"], "a") as f:
        f.write(f"{time.time()}\n")
    return sleepy_reward(response, label, metadata)


def crash_reward(response: str, label: Any, metadata: Metadata = None) -> float:
    if (metadata or {}).get("crash"):
        os._exit(3)
    if (metadata or {}).get("segfault"):
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return 1.0 if response.strip() == str(label) else 0.0


def length_reward(
    response: str, label: Any, metadata: Metadata = None, *, scale: float = 1.0
) -> dict[str, Any]:
    """A dict reward: the configured key picks the scalar."""
    return {"len": scale * len(response), "match": float(response == label), "note": "not a number"}


_started: dict[str, int] = {}


async def async_match_reward(response: str, label: Any, metadata: Metadata = None) -> float:
    """Matches after ``delay`` s; with ``meet`` it first waits until that many calls tagged with the same
    ``batch`` have started, which only calls awaited together (not one after another) ever see."""
    md = metadata or {}
    if "meet" in md:
        _started[md["batch"]] = _started.get(md["batch"], 0) + 1
        while _started[md["batch"]] < md["meet"]:
            await asyncio.sleep(0.01)
    await asyncio.sleep(float(md.get("delay", 0.2)))
    return 1.0 if response.strip() == str(label) else 0.0


@group_reward
def rank_group_reward(responses: list[str], labels: list[Any], metadatas: list[Metadata]) -> list[float]:
    """Per-group: 1.0 for the shortest response of the group, 0.0 for the others (needs the group)."""
    shortest = min(len(r) for r in responses)
    return [1.0 if len(r) == shortest else 0.0 for r in responses]


@group_reward
def wrong_length_group_reward(
    responses: list[str], labels: list[Any], metadatas: list[Metadata]
) -> list[float]:
    return [1.0]


@register("fixture_boom")
def registered_boom_reward(response: str, label: Any, metadata: Metadata = None) -> float:
    """Registered by name when this file is imported as a plug-in (reward.plugins)."""
    return boom_reward(response, label, metadata)


def pid_reward(response: str, label: Any, metadata: Metadata = None) -> float:
    """Reports which process scored the sample."""
    time.sleep(0.05)
    return float(os.getpid())
