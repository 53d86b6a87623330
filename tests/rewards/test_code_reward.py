"""reward=code: programs scored by their tests in a real sandbox; escape attempts score 0 and change nothing."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from relax_rewards import RewardExecutor, RewardItem
from relax_rewards.code import _UID_BASE, code_reward, extract_program

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the sandbox uses POSIX limits")

FAST = {"cpu_s": 1.0, "wall_s": 1.5, "output_kb": 64, "memory_mb": 200}


def _sandbox_pids() -> list[int]:
    """Live processes running as a sandbox uid (zombies included)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid >= _UID_BASE:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _code_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("relax-code-*"))


def test_code_reward_scores_stdin_and_assert_tests() -> None:
    label = {
        "tests": [{"stdin": "2 3\n", "stdout": "5"}, {"stdin": "10 -4\n", "stdout": "6\n"}],
        "asserts": ["assert add(2, 3) == 5", "assert add(0, 0) == 1"],
    }
    # assert tests run the program (with empty stdin), then evaluate add(...) on it
    response = (
        "Here:\n```python\nimport sys\ndef add(a, b):\n    return a + b\n\nargs = sys.stdin.read().split()\n"
        "if args:\n    print(add(*map(int, args)))\n```\n"
    )
    out = code_reward(response, label, **FAST)
    assert out["score"] == out["pass_rate"] == 0.75 and out["num_tests"] == 4 and out["timeouts"] == 0
    assert code_reward(response, label, all_or_nothing=True, **FAST)["score"] == 0.0
    # no fence: the whole text is the program; a JSON-string label works the same
    assert (
        code_reward(
            "print(sum(map(int, input().split())))", '{"tests": [{"stdin": "1 2", "stdout": "3"}]}', **FAST
        )["score"]
        == 1.0
    )
    assert extract_program("```py\na\n```\n```python\nb\n```") == "b\n"
    with pytest.raises(ValueError, match='no "tests" and no "asserts"'):
        code_reward("print(1)", {"tests": []}, **FAST)


def test_code_reward_escapes_score_zero_and_change_nothing(tmp_path: Path) -> None:
    outside = Path(tempfile.mkdtemp(prefix="relax-canary-", dir="/tmp"))
    outside.chmod(0o755)  # reachable, so only permissions keep the canary alive
    canary = outside / "canary.txt"
    canary.write_text("alive")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    before = _code_dirs()
    ok = "print('ok')\n"  # each program ends by printing the expected output, so only a block scores 0
    programs = {
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "infinite_loop": "while True:\n    pass\n",
        "huge_output": "while True:\n    print('x' * 100000)\n",
        # the host's /tmp is not even visible in the sandbox now: the canary must be seen to count
        "rm_rf": f"import os, subprocess\nassert os.path.exists({str(canary)!r})\n"
        f"subprocess.run(['rm', '-rf', os.getcwd(), {str(canary)!r}])\nassert not os.path.exists({str(canary)!r})\n",
        "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'x')\n",
        "memory_bomb": "x = bytearray(4 << 30)\n",
    }
    cfg = {"name": "code", "num_workers": 0, "concurrency": 8, "timeout_s": 30.0, "kwargs": FAST}
    with RewardExecutor.from_config(cfg) as ex:
        items = [
            RewardItem(name, prog + ok, {"tests": [{"stdout": "ok"}]}) for name, prog in programs.items()
        ]
        outcomes = dict(zip(programs, ex.score(items), strict=True))
    try:
        for name, out in outcomes.items():
            assert out.error is None and out.reward == 0.0, (name, out)
        assert outcomes["infinite_loop"].extras["timeouts"] == 1.0
        assert canary.read_text() == "alive"
        listener.settimeout(0.0)
        with pytest.raises(BlockingIOError):
            listener.accept()
        # a killed sandbox process may still be a zombie for a moment on a loaded host; one that is still
        # there after a while escaped
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and (_sandbox_pids() or _code_dirs() != before):
            time.sleep(0.2)
        assert _sandbox_pids() == [], "a sandboxed process outlived its run"
        assert _code_dirs() == before, "a sandbox's working directory was left behind"
    finally:
        listener.close()
        canary.unlink()
        outside.rmdir()
