"""reward=code against adversarial programs: forged passes, leaks of labels and siblings, shared state, limits
per sandbox, survivors of a killed worker, and a weak sandbox refused at launch. As root (CI) none is
skipped; every class scored 1.0, leaked or survived before the sandbox held the harness out of reach."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from relax_rewards import code as code_mod
from relax_rewards.code import (
    _UID_BASE,
    check_sandbox,
    code_reward,
    plan_asserts,
    run_sandboxed,
    sandbox_python,
)

pytestmark = [
    pytest.mark.skipif(os.name != "posix", reason="the sandbox uses POSIX namespaces and limits"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the full sandbox needs root (CI runs as root)"),
]

FAST = {"cpu_s": 1.0, "wall_s": 2.0, "output_kb": 64, "memory_mb": 200}
SQUARE = {"asserts": ["assert f(3) == 9", "assert f(4) == 16"]}
REPO = Path(__file__).resolve().parents[2]


def score(program: str, label: Any, **kw: Any) -> dict[str, float]:
    return code_reward(f"```python\n{textwrap.dedent(program)}```", label, **{**FAST, **kw})


def scores(programs: dict[str, str], label: Any, **kw: Any) -> dict[str, dict[str, float]]:
    with ThreadPoolExecutor(len(programs)) as pool:
        futures = {name: pool.submit(score, prog, label, **kw) for name, prog in programs.items()}
        return {name: f.result() for name, f in futures.items()}


def _sandbox_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid >= _UID_BASE:
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def test_honest_programs_pass_every_assert_form() -> None:
    label = {
        "asserts": [
            "assert f(3) == 9",
            "assert f(2) == 4 and f(-1) == 1, 'message'",
            "assert not f(0)",
            "assert abs(g(2.0) - 1.4142) < 1e-3",
            "assert math.isclose(g(2.0), 1.41421356, rel_tol=1e-6)",
            "assert set(pairs(3)) == {(0, 1), (1, 2)}",
            "assert sorted(h()) == [i * 2 for i in range(3)]",
            "assert isinstance(d(), dict) and d()['k'] == [b'x', None, 1.5]",
            "assert len(pairs(5)) == 4 and pairs(5)[-1] == (3, 4)",
            "assert f(10) ** 2 == 10 ** 4",
            "assert type(f(1)) is int",
        ]
    }
    program = """
    import math
    def f(n): return n * n
    def g(x): return math.sqrt(x)
    def pairs(n): return [(i, i + 1) for i in range(n - 1)]
    def h(): return [4, 0, 2]
    def d(): return {"k": [b"x", None, 1.5]}
    """
    out = score(program, label)
    assert out["score"] == 1.0 and out["num_tests"] == len(label["asserts"]), out
    assert score("def f(n): return n * 3\n", SQUARE)["score"] == 0.5  # f(3) right, f(4) wrong
    with pytest.raises(ValueError, match="not a line of assert statements"):
        plan_asserts(["x = f(3)\nassert x == 9"])


def test_forged_exits_equality_tricks_and_harness_edits_score_zero() -> None:
    wrong = "def f(n): return -1\n"
    programs = {
        "sys_exit": wrong + "import sys\nsys.exit(0)\n",
        "os_exit": wrong + "import os\nos._exit(0)\n",
        "atexit": wrong + "import atexit, os\natexit.register(lambda: os._exit(0))\n",
        "excepthook": wrong + "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n",
        "always_equal": "class A:\n    def __eq__(self, o): return True\n    __hash__ = None\ndef f(n): return A()\n",
        "int_subclass": "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
        "def f(n): return I(0)\n",
        # reads the tests wherever they might be: its own file, its command line, any process's, its fds
        "read_tests": """
        import glob, re
        text = ""
        for p in [__file__, "/proc/self/cmdline", *glob.glob("/proc/*/cmdline"), *glob.glob("/proc/self/fd/*")]:
            try:
                text += open(p, errors="replace").read()
            except Exception:
                pass
        table = dict(re.findall(r"f\\((\\d+)\\) == (\\d+)", text))
        def f(n): return int(table.get(str(n), -1))
        """,
        # edits what evaluates the tests: every evaluation answers True, every comparison holds
        "harness_edit": wrong + "import builtins\nbuiltins.eval = lambda *a, **k: True\n",
        # the expected side of an assert computed by builtins the program patched
        "patch_builtin": "import builtins\nbuiltins.sorted = lambda *a, **k: -1\ndef f(n): return -1\n",
        "forge_channel": wrong
        + 'import os\nfor i in range(4):\n    os.write(4, b\'{"i": %d, "v": true}\\n\' % i)\n',
    }
    label = {"asserts": [*SQUARE["asserts"], "assert f(5) == sorted([25])"]}
    got = {name: out["score"] for name, out in scores(programs, label).items()}
    assert got == dict.fromkeys(programs, 0.0)


def test_no_label_sibling_or_run_file_is_visible() -> None:
    """A secret on a host process's command line (the scorer's ``data.train_path=``), in a concurrent
    sample's program, and in a run directory's config outside the launch folder: none is readable."""
    run_dir = Path(tempfile.mkdtemp(prefix="relax-run-", dir="/tmp"))
    run_dir.chmod(0o755)
    (run_dir / "config.yaml").write_text("reward:\n  kwargs:\n    api_key: 271828\n")
    (run_dir / "config.yaml").chmod(0o644)
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "data.train_path=/s/4242"])
    scan = """
    import glob, re, time
    found = ""
    deadline = time.time() + {wait}
    while not found and time.time() < deadline:
        for p in glob.glob("/proc/*/cmdline") + glob.glob("/proc/*/environ"):
            try:
                m = re.search(r"{pattern}", open(p, errors="replace").read())
            except Exception:
                continue
            if m:
                found = m.group(1)
    print(found)
    """
    sibling = "# SIBLING-SECRET-31337\nimport time\ntime.sleep(1.5)\nprint('done')\n"
    read_run = f"print(open({str(run_dir / 'config.yaml')!r}).read().split()[-1])\n"
    try:
        with ThreadPoolExecutor(4) as pool:
            jobs = {
                "host_cmdline": pool.submit(
                    score,
                    scan.format(wait=0.1, pattern=r"train_path=/s/(\d+)"),
                    {"tests": [{"stdout": "4242"}]},
                ),
                "sibling": pool.submit(
                    score,
                    scan.format(wait=1.2, pattern=r"SIBLING-SECRET-(\d+)"),
                    {"tests": [{"stdout": "31337"}]},
                ),
                "sibling_itself": pool.submit(score, sibling, {"tests": [{"stdout": "done"}]}),
                "run_dir": pool.submit(score, read_run, {"tests": [{"stdout": "271828"}]}),
            }
            outs = {name: job.result() for name, job in jobs.items()}
    finally:
        host.kill()
        host.wait()
        for f in run_dir.iterdir():
            f.unlink()
        run_dir.rmdir()
    got = {name: out["score"] for name, out in outs.items()}
    assert got == {"host_cmdline": 0.0, "sibling": 0.0, "sibling_itself": 1.0, "run_dir": 0.0}


def test_tmp_shm_ipc_and_unix_sockets_are_private_and_gone_after_the_sample() -> None:
    tag = f"relax-leak-{os.getpid()}"
    dirs = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock"]
    sock_path = f"/tmp/{tag}.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    os.chmod(sock_path, 0o777)
    listener.listen()
    listener.settimeout(0.0)
    shm_key = 0x5EED0000 + os.getpid() % 0xFFFF
    writer = f"""
    import ctypes, os, socket
    wrote = []
    for d in {dirs!r}:
        try:
            with open(os.path.join(d, {tag!r}), "w") as f:
                f.write("left by an earlier sample")
            wrote.append(d)
        except OSError:
            pass
    libc = ctypes.CDLL(None)
    shm = libc.shmget({shm_key}, 4096, 0o1000 | 0o666)  # IPC_CREAT
    try:
        socket.socket(socket.AF_UNIX).connect({sock_path!r})
        sock = "connected"
    except OSError:
        sock = "refused"
    print(len(wrote), shm >= 0, sock)
    """
    reader = f"""
    import ctypes, os
    seen = [d for d in {dirs!r} if os.path.exists(os.path.join(d, {tag!r}))]
    print(len(seen), ctypes.CDLL(None).shmget({shm_key}, 0, 0) >= 0)
    """
    try:
        wrote = score(writer, {"tests": [{"stdout": "4 True refused"}]})
        read = score(reader, {"tests": [{"stdout": "0 False"}]})
        with pytest.raises(BlockingIOError):
            listener.accept()
        leaked = [d for d in dirs if os.path.exists(os.path.join(d, tag))]
        shm_listed = f"{shm_key:d}" in Path("/proc/sysvipc/shm").read_text().split()
    finally:
        listener.close()
        os.unlink(sock_path)
        for d in dirs:
            Path(d, tag).unlink(missing_ok=True)
    assert wrote["score"] == 1.0, "the program could not write its own tmp, shm and IPC"
    assert read["score"] == 1.0, "a later sample saw what an earlier one left"
    assert leaked == [] and not shm_listed, (leaked, shm_listed)


def test_memory_and_cpu_are_bounded_per_sandbox_not_per_process() -> None:
    memory = """
    import os, time
    pids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            b = b"x" * (90 << 20)  # 90 MB each, touched: 360 MB in all against 200 MB
            time.sleep(1.0)
            os._exit(0)
        pids.append(pid)
    print("ok" if all(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in pids) else "killed")
    """
    cpu = """
    import os, time
    pids = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            t = time.process_time()
            while time.process_time() - t < 0.8:  # 0.8 CPU-s each, under the per-process 1 s
                pass
            os._exit(0)
        pids.append(pid)
    for p in pids:
        os.waitpid(p, 0)
    print("ok")
    """
    ok = {"tests": [{"stdout": "ok"}]}
    out = score(memory, ok, wall_s=8.0)
    assert out["score"] == 0.0, out
    out = score(cpu, ok, wall_s=10.0)
    assert out["score"] == 0.0 and out["timeouts"] == 1.0, out


def test_fresh_uid_per_sandbox() -> None:
    uids = [run_sandboxed("import os; print(os.getuid())").stdout.strip() for _ in range(2)]
    assert uids[0] != uids[1] and all(int(u) >= _UID_BASE for u in uids), uids


def test_a_worker_killed_mid_test_leaves_nothing_behind() -> None:
    before = set(Path(tempfile.gettempdir()).glob("relax-code-*"))
    script = (
        "from relax_rewards.code import code_reward\n"
        "code_reward('while True: pass', {'tests': [{'stdout': 'x'}]}, wall_s=3.0, cpu_s=3.0)\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script], cwd=REPO)
    try:
        deadline = time.monotonic() + 20.0
        while not _sandbox_pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _sandbox_pids(), "the worker's sandbox never started"
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline and _sandbox_pids():
        time.sleep(0.1)
    assert _sandbox_pids() == [], "a sandbox process outlived its killed worker past its wall time"
    assert set(Path(tempfile.gettempdir()).glob("relax-code-*")) == before, "a working folder was left"
    assert run_sandboxed("print(1)").stdout == "1\n"  # the next sandbox sweeps the dead worker's cgroup
    parents = code_mod._v2_parent() or code_mod._v1_parents()
    left = [p for d in set(parents.values()) for p in d.glob(f"relax-code-{worker.pid}-*")]
    assert left == [], left


def test_weak_sandbox_and_unappliable_hide_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    interpreter_dir = str(Path(sandbox_python()).resolve().parent)
    res = run_sandboxed("print(1)", limits=code_mod.SandboxLimits(hide_paths=(interpreter_dir,)))
    assert res.error and "cannot hide" in res.error and interpreter_dir in res.error, res
    with pytest.raises(ValueError, match="cannot hide"):
        check_sandbox({"hide_paths": [interpreter_dir]})
    check_sandbox({})  # the full sandbox, as root with cgroups

    monkeypatch.setattr(code_mod._Cgroup, "create", classmethod(lambda cls, *a: None))
    with pytest.raises(ValueError, match=r"weak sandbox \(no cgroup.*allow_weak_sandbox=true"):
        check_sandbox({})
    with pytest.raises(RuntimeError, match="weak sandbox"):
        score("print(1)", {"tests": [{"stdout": "1"}]})
    check_sandbox({"allow_weak_sandbox": True})
    assert score("print(1)", {"tests": [{"stdout": "1"}]}, allow_weak_sandbox=True)["score"] == 1.0

    monkeypatch.setattr(code_mod.os, "geteuid", lambda: 1000)  # the non-root path
    with pytest.raises(ValueError, match=r"weak sandbox \(not root"):
        check_sandbox({"allow_network_fallback": True})
    check_sandbox({"allow_weak_sandbox": True})
