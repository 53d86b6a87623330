"""Environments that misbehave on purpose (importable by dotted path, as rollout.env._target_ needs)."""

from __future__ import annotations

import asyncio
import threading
import time

from relax_core.agentic.env import BaseInteractionEnv

# a test replaces both before it builds its environments (each FlakyEnv keeps the pair it was built with, so
# a hung step of an earlier test, released late, sets that test's event, not this one's)
RELEASE = threading.Event()  # lets a test end the hung threads it caused
HUNG_STEP_RETURNED = threading.Event()  # set when a hung step is released: nothing may wait for it


class EchoEnv(BaseInteractionEnv):
    """Never done; answers every turn with ``ok`` (ends on max_turns or the context budget)."""

    def __init__(self, label=None, metadata=None, seed=0, reply: str = "ok") -> None:
        super().__init__(label, metadata, seed)
        self.reply = reply

    def step(self, response_text):
        return self.reply, False, {}


class NoRewardEnv(BaseInteractionEnv):
    """Done after one turn without a reward: the run's reward function must score the response."""

    def step(self, response_text):
        return None, True, {"seen": 1.0}


class FlakyEnv(BaseInteractionEnv):
    """Per the row's metadata ``mode``: ``ok`` (reward 1 after two turns), ``raise`` in step, ``hang`` in
    step (until RELEASE), ``raise_reset``, or ``async`` (an async step that also succeeds)."""

    def __init__(self, label=None, metadata=None, seed=0) -> None:
        super().__init__(label, metadata, seed)
        self.mode = self.metadata.get("mode", "ok")
        self.turns = 0
        self.release, self.returned = RELEASE, HUNG_STEP_RETURNED

    def reset(self):
        if self.mode == "raise_reset":
            raise RuntimeError("reset exploded")
        return None, {}

    def step(self, response_text):
        if self.mode == "async":
            return self._async_step()
        self.turns += 1
        if self.mode == "raise":
            raise ValueError("tool crashed")
        if self.mode == "hang":
            self.release.wait(60)
            self.returned.set()
            return "late", False, {}
        return ("again", False, {}) if self.turns < 2 else (None, True, {"reward": 1.0, "acc": 1.0})

    async def _async_step(self):
        await asyncio.sleep(0.01)
        self.turns += 1
        return ("again", False, {}) if self.turns < 2 else (None, True, {"reward": 1.0, "acc": 1.0})


class SlowThenOkEnv(BaseInteractionEnv):
    """Sleeps ``delay`` seconds per step, then finishes (checks the limit is per step, not per episode)."""

    def __init__(self, label=None, metadata=None, seed=0, delay: float = 0.2) -> None:
        super().__init__(label, metadata, seed)
        self.delay = delay

    def step(self, response_text):
        time.sleep(self.delay)
        return None, True, {"reward": 0.5}


class ImageEnv(BaseInteractionEnv):
    """Returns a small picture after each turn (visual context that grows across turns)."""

    def step(self, response_text):
        import numpy as np
        from PIL import Image

        picture = Image.fromarray(
            (np.random.default_rng(self.seed).random((64, 64, 3)) * 255).astype("uint8")
        )
        return {"content": "look", "images": [picture]}, False, {}


class FlakyCalculatorEnv(BaseInteractionEnv):
    """The calculator task, but some episodes' tool raises (seed % 4 == 1) or hangs (seed % 4 == 2)."""

    def __init__(self, label=None, metadata=None, seed=0) -> None:
        from relax_core.agentic.envs import CalculatorEnv

        super().__init__(label, metadata, seed)
        self.inner = CalculatorEnv(label, metadata, seed)

    def step(self, response_text):
        if self.seed % 4 == 1:
            raise ConnectionError("calculator service unreachable")
        if self.seed % 4 == 2:
            time.sleep(30)
        return self.inner.step(response_text)
