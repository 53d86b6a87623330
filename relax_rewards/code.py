"""``code``: run a response's Python program against the dataset row's tests, in a sandbox.

The program is the last fenced ```python (or bare ```) block of the response, else the whole response.
The label (a dict, or a JSON string of one) holds its tests; at least one is needed::

    {"tests": [{"stdin": "2 3\\n", "stdout": "5"}],     # stdout must match, trailing whitespace ignored
     "asserts": ["assert add(2, 3) == 5"]}              # program + this line must exit 0

Every test runs in its own sandbox (:func:`run_sandboxed`): a fresh process that sets up the limits and
namespaces and then executes ``python -I -S`` on the program. What protects what:

- **processes**: the program is a session and process-group leader; as root it runs as a uid of its own
  (one per concurrent sandbox, no passwd entry), so RLIMIT_NPROC bounds its processes alone, and afterwards
  every process of that uid is killed (``kill(-1)`` from that uid), including ones that left the group;
  the sandbox process is their subreaper and reaps them. Not root: RLIMIT_NPROC counts all of the user's
  processes (so forking mostly fails) and only the program's process group is killed.
- **resources**: RLIMIT_CPU (CPU seconds), RLIMIT_AS (memory), RLIMIT_FSIZE (each file, and the captured
  stdout/stderr, which are files: a write past it fails with EFBIG), RLIMIT_NOFILE; wall time is
  enforced by the sandbox process (killpg) with a backstop here.
- **network**: a fresh network namespace (only a down loopback), made with ``unshare`` (as root, else
  inside a new user namespace). Where that fails the test is refused unless ``allow_network_fallback``.
- **files**: as root, a private mount namespace: the working directory is a fresh tmpfs of ``disk_mb``
  owned by the sandbox uid (HOME and TMPDIR point at it), and each of ``hide_paths`` plus the caller's
  working directory (the launch directory, holding ``outputs/``) is covered by an empty read-only tmpfs.
  Everything else is as the sandbox uid sees it: others' 0700 folders unreadable, nothing of root's
  writable. The environment is scrubbed (PATH, HOME, TMPDIR, LANG only). Not root: a temporary directory
  and the user's own permissions, nothing hidden.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_rewards.registry import register

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# uids of root-mode sandboxes: base + pid * slots + slot is unique among live processes (pid_max <= 2**22)
_UID_BASE, _UID_SLOTS = 100_000_000, 512
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()

# Runs as the caller's user, single-threaded, before the program: namespaces, limits, uid, then exec.
# Prints one JSON status line; a["fds"] are the program's stdin, stdout, stderr.
_BOOT = r"""
import ctypes, json, os, resource, signal, sys, time
a = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
root = os.geteuid() == 0
st = {"netns": False, "mountns": False, "timed_out": False}
def die(msg):
    st["error"] = msg
    print(json.dumps(st), flush=True)
    os._exit(0)
if root:
    st["netns"] = st["mountns"] = libc.unshare(0x40000000 | 0x00020000) == 0
    if not st["netns"]:
        st["netns"] = libc.unshare(0x40000000) == 0
else:
    st["netns"] = libc.unshare(0x10000000 | 0x40000000) == 0
if not st["netns"] and not a["allow_network"]:
    die("no network namespace: " + os.strerror(ctypes.get_errno()))
if st["mountns"]:
    MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 1, 2, 4, 1 << 14, 1 << 18
    def mount(target, flags, data):
        if libc.mount(b"tmpfs", target.encode(), b"tmpfs", flags, data.encode()) != 0:
            die("cannot mount a tmpfs on " + target + ": " + os.strerror(ctypes.get_errno()))
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        die("cannot make mounts private: " + os.strerror(ctypes.get_errno()))
    for path in a["hide"]:
        mount(path, MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    mount(a["cwd"], MS_NOSUID | MS_NODEV, "size=%dk,mode=0700,uid=%d,gid=%d" % (a["disk_kb"], a["uid"], a["uid"]))
elif root:
    os.chown(a["cwd"], a["uid"], a["uid"])
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: escaped descendants come back here to be reaped
with open(os.path.join(a["cwd"], "main.py"), "w") as f:
    f.write(a["program"])
if root:
    os.chown(os.path.join(a["cwd"], "main.py"), a["uid"], a["uid"])
pid = os.fork()
if pid == 0:
    try:
        os.setsid()
        for to, fd in enumerate(a["fds"]):
            os.dup2(fd, to)
        os.closerange(3, 1 << 16)
        for name, soft, hard in a["limits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if root:
            os.setgroups([])
            os.setgid(a["uid"])
            os.setuid(a["uid"])
        os.chdir(a["cwd"])
        os.execve(a["argv"][0], a["argv"], a["env"])
    finally:
        os._exit(127)
def on_alarm(*_):
    st["timed_out"] = True
    os.killpg(pid, signal.SIGKILL)
signal.signal(signal.SIGALRM, on_alarm)
signal.setitimer(signal.ITIMER_REAL, a["wall_s"])
_, status = os.waitpid(pid, 0)
signal.setitimer(signal.ITIMER_REAL, 0)
st["returncode"] = os.waitstatus_to_exitcode(status)
if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
    st["timed_out"] = True  # the CPU-time limit: the same verdict as the wall clock's
try:
    os.killpg(pid, signal.SIGKILL)
except OSError:
    pass
if root:
    killer = os.fork()
    if killer == 0:
        os.setgroups([])
        os.setgid(a["uid"])
        os.setuid(a["uid"])
        for _ in range(1000):
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                break
        os._exit(0)
deadline = time.monotonic() + 5.0
while time.monotonic() < deadline:
    try:
        if os.waitpid(-1, 0 if root else os.WNOHANG)[0] == 0:
            break
    except ChildProcessError:
        break
print(json.dumps(st), flush=True)
"""


@dataclass
class SandboxResult:
    """What one sandboxed run did: exit code (negative: killed by that signal), captured output, whether
    the wall-time limit killed it, and ``error`` when the sandbox itself could not be set up."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    netns: bool
    error: str | None = None


def _accessible_to_others(path: str) -> bool:
    """Whether a uid that is neither owner nor group can execute ``path`` (every parent searchable)."""
    p = Path(path).resolve()
    try:
        if not p.stat().st_mode & 0o005 == 0o005:
            return False
        return all(parent.stat().st_mode & 0o001 for parent in p.parents)
    except OSError:
        return False


def sandbox_python() -> str:
    """The interpreter programs run with: this one, or as root (programs run as another uid) the first of
    this one, /usr/bin/python3, /usr/local/bin/python3 that any uid can execute."""
    if os.geteuid() != 0:
        return sys.executable
    for cand in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if cand and _accessible_to_others(cand):
            return cand
    raise RuntimeError(
        f"reward=code: no Python interpreter the sandbox uid can execute ({sys.executable} sits in a folder "
        "others cannot enter); install python3 under /usr/bin"
    )


def _take_uid() -> int:
    with _uid_lock:
        for slot in range(_UID_SLOTS):
            uid = _UID_BASE + os.getpid() * _UID_SLOTS + slot
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid
    raise RuntimeError(f"reward=code: more than {_UID_SLOTS} sandboxes at once in one process")


def _read_capped(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        return f.read(limit).decode("utf-8", "replace")


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed program may use (``reward.kwargs`` of ``reward=code``, see conf/reward/code.yaml)."""

    cpu_s: float = 2.0
    wall_s: float = 4.0
    memory_mb: int = 256
    output_kb: int = 256
    disk_mb: int = 16
    max_processes: int = 8
    max_open_files: int = 64
    allow_network_fallback: bool = False
    hide_paths: tuple[str, ...] = ()


def run_sandboxed(program: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``program`` with ``python -I -S`` in a sandbox (see the module doc) and capture its output."""
    root = os.geteuid() == 0
    python = sandbox_python()
    uid = _take_uid() if root else os.getuid()
    base = Path(tempfile.mkdtemp(prefix="relax-code-"))
    try:
        os.chmod(base, 0o711)  # the sandbox uid may enter its working directory, not list its siblings
        work = base / "work"
        work.mkdir(mode=0o700)
        caller_cwd = os.getcwd()
        hide = [
            str(Path(p).resolve())
            for p in (*limits.hide_paths, caller_cwd)
            if Path(p).is_dir()
            and not Path(python).resolve().is_relative_to(Path(p).resolve())
            and not base.is_relative_to(Path(p).resolve())
        ]
        (base / "stdin").write_text(stdin)
        out_cap = limits.output_kb * 1024
        rlimits = [
            ("RLIMIT_CPU", max(1, round(limits.cpu_s)), max(1, round(limits.cpu_s)) + 1),
            ("RLIMIT_AS", limits.memory_mb << 20, limits.memory_mb << 20),
            ("RLIMIT_FSIZE", out_cap, out_cap),
            ("RLIMIT_NPROC", limits.max_processes, limits.max_processes),
            ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
            ("RLIMIT_CORE", 0, 0),
        ]
        args = {
            "uid": uid,
            "cwd": str(work),
            "hide": hide,
            "disk_kb": limits.disk_mb * 1024,
            "program": program,
            "limits": rlimits,
            "wall_s": float(limits.wall_s),
            "allow_network": bool(limits.allow_network_fallback),
            "argv": [python, "-I", "-S", "main.py"],
            "env": {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"},
        }
        with (
            open(base / "stdin", "rb") as fin,
            open(base / "stdout", "wb") as fout,
            open(base / "stderr", "wb") as ferr,
        ):
            fds = [os.dup(f.fileno()) for f in (fin, fout, ferr)]
            args["fds"] = fds
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _BOOT, json.dumps(args)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=fds,
                    start_new_session=True,
                    env={"PATH": "/usr/bin:/bin"},
                )
            finally:
                for fd in fds:
                    os.close(fd)
        try:
            boot_out, boot_err = proc.communicate(timeout=limits.wall_s + 10.0)
        except subprocess.TimeoutExpired:  # backstop: the sandbox process itself hung
            os.killpg(proc.pid, 9)
            proc.communicate()
            return SandboxResult(None, "", "", True, False, "sandbox process did not finish")
        line = boot_out.decode(errors="replace").strip().splitlines()
        if not line:
            err = boot_err.decode(errors="replace").strip().splitlines()
            return SandboxResult(
                None, "", "", False, False, f"sandbox failed: {err[-1] if err else proc.returncode}"
            )
        st = json.loads(line[-1])
        return SandboxResult(
            st.get("returncode"),
            _read_capped(base / "stdout", out_cap),
            _read_capped(base / "stderr", out_cap),
            bool(st["timed_out"]),
            bool(st["netns"]),
            st.get("error"),
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if root:
            with _uid_lock:
                _uids_in_use.discard(uid)


def extract_program(response: str) -> str:
    """The last fenced ```python (or bare ```) block of ``response``, else the whole text."""
    blocks = _FENCE.findall(response or "")
    return blocks[-1] if blocks else (response or "")


def _tests(label: Any) -> tuple[list[dict[str, str]], list[str]]:
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except ValueError:
            raise ValueError("code reward: label is a string but not JSON") from None
    if not isinstance(label, dict):
        raise ValueError(
            f'code reward: label must be {{"tests": [...], "asserts": [...]}}, got {type(label).__name__}'
        )
    cases = label.get("tests") or []
    asserts = label.get("asserts") or []
    if not all(isinstance(c, dict) and "stdout" in c for c in cases) or not all(
        isinstance(a, str) for a in asserts
    ):
        raise ValueError(
            'code reward: label "tests" must be [{"stdin": str, "stdout": str}], "asserts" [str]'
        )
    if not cases and not asserts:
        raise ValueError('code reward: label has no "tests" and no "asserts"')
    return cases, asserts


def _same_output(got: str, want: str) -> bool:
    norm = lambda s: [line.rstrip() for line in s.strip().splitlines()]  # noqa: E731
    return norm(got) == norm(want)


def code_reward(
    response: str,
    label: Any,
    metadata: dict[str, Any] | None = None,
    *,
    all_or_nothing: bool = False,
    **limits: Any,
) -> dict[str, float]:
    """Share of the row's tests the program passes (1.0 only when all pass with ``all_or_nothing``).

    Extras: ``pass_rate`` (share passed), ``all_passed``, ``num_tests``, ``timeouts`` (tests killed at the
    wall-time or CPU-time limit). A sandbox that cannot be set up (no network namespace without
    ``allow_network_fallback``) raises, so the sample is a counted reward error, not a silent 0.
    """
    cases, asserts = _tests(label)
    program = extract_program(response)
    sandbox = sandbox_limits(limits)
    runs = [(program, c.get("stdin") or "", str(c["stdout"])) for c in cases]
    runs += [(f"{program}\n\n{a}\n", "", None) for a in asserts]
    passed = timeouts = 0
    for source, stdin, want in runs:
        res = run_sandboxed(source, stdin, sandbox)
        if res.error:
            raise RuntimeError(f"code reward sandbox: {res.error}")
        timeouts += res.timed_out
        ok = res.returncode == 0 and not res.timed_out
        passed += ok and (want is None or _same_output(res.stdout, want))
    rate = passed / len(runs)
    all_passed = float(passed == len(runs))
    return {
        "score": all_passed if all_or_nothing else rate,
        "pass_rate": rate,
        "all_passed": all_passed,
        "num_tests": float(len(runs)),
        "timeouts": float(timeouts),
    }


def sandbox_limits(kwargs: dict[str, Any]) -> SandboxLimits:
    """``reward.kwargs`` as limits; an unknown key is a ValueError naming it and the known ones."""
    known = set(SandboxLimits.__dataclass_fields__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"reward=code: unknown reward.kwargs {unknown}; known: all_or_nothing, {sorted(known)}"
        )
    return SandboxLimits(**{**kwargs, "hide_paths": tuple(kwargs.get("hide_paths") or ())})


def check_sandbox(kwargs: dict[str, Any]) -> None:
    """Launch check: ValueError in one line when this machine cannot give programs their own network
    namespace and ``reward.kwargs.allow_network_fallback`` is not set, or the sandbox cannot start."""
    sandbox_limits({k: v for k, v in kwargs.items() if k != "all_or_nothing"})  # unknown keys: one line
    res = run_sandboxed("print(1)", limits=SandboxLimits(wall_s=10.0, allow_network_fallback=True))
    if res.error or res.returncode != 0:
        raise ValueError(
            f"reward=code: the sandbox cannot run a program here: {res.error or res.stderr.strip()[-200:]}"
        )
    if not res.netns and not kwargs.get("allow_network_fallback"):
        raise ValueError(
            "reward=code: this machine gives no network namespace to sandboxed programs (unshare refused); "
            "set reward.kwargs.allow_network_fallback=true to run them with the network"
        )


register("code", key="score", needs_label=True, check=check_sandbox)(code_reward)
