"""A misbehaving agent program for the failure-path test: the example calculator agent, except that the
second episode of every group crashes the program, the third hangs it and the fourth never reports a
reward (the program moves on to its next episode)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "agents"))

import calc_agent  # noqa: E402


def main() -> None:
    while True:
        episode = calc_agent.post(calc_agent.EPISODES_URL, {})
        if episode["done"]:
            return
        kind = episode["index_in_group"] % 4
        if kind == 0:
            calc_agent.play(episode, calc_agent.chat_urllib)
            continue
        calc_agent.chat_urllib(episode["session_id"], episode["messages"])
        if kind == 1:
            sys.exit(3)
        if kind == 2:
            time.sleep(3600)


if __name__ == "__main__":
    main()
