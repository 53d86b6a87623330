"""``code``: run a response's Python program against the dataset row's tests, in a sandbox.

The program is the last fenced ```python (or bare ```) block of the response, else the whole response.
The label (a dict, or a JSON string of one) holds its tests; at least one is needed::

    {"tests": [{"stdin": "2 3\\n", "stdout": "5"}],     # stdout must match, trailing whitespace ignored
     "asserts": ["assert add(2, 3) == 5"]}              # the assert's condition must hold

**The harness is out of the program's reach.** No expected value ever enters the sandbox:

- a stdin/stdout test passes when the program exits 0 within its limits and the stdout it wrote matches
  the expected text, compared here;
- an assert is parsed here (:func:`plan_asserts`): its literal parts and the skeleton around them
  (comparisons, ``and``/``or``/``not``, arithmetic, subscripts, and calls of a few builtins such as ``len``,
  ``sorted``, ``set``, ``abs``, ``round``, ``isinstance`` and ``math.isclose``) stay here, and only the
  remaining leaves (``add(2, 3)``) go to the sandbox. There the harness runs the program's source in a fresh
  ``__main__`` module, evaluates each leaf and writes its value back through a strict encoder (None, bool,
  int, float, str, bytes and lists, tuples, dicts, sets of those, exact types: an object with its own
  ``__eq__`` is a failed assert). The skeleton is evaluated here on the values. A program that exits,
  raises or is killed before the leaves are evaluated gives no values: its asserts fail. A program can
  write whatever it likes on the result channel, but only values for the leaves it was asked, never
  the expected ones, which it never sees.
- A leaf that names nothing but builtins and stdlib modules (``sorted([3, 1])``, ``math.pi``) is the
  label's, not the program's: it is evaluated in the same sandbox in an interpreter of its own, before
  the program runs, so the program can neither read it nor patch what it calls. A builtin's name in an
  assert always means the builtin, even where the program defines its own.

The program and the leaves reach the sandbox through a file descriptor (never argv or a file with the
tests in it). All tests of a sample run in one sandbox, one interpreter per stdin/stdout test and one
for all the asserts (evaluated one after another on one run of the program; each counts by itself).

**The sandbox, as root** (:func:`run_sandboxed`, full isolation):

- namespaces: new pid (a fresh ``/proc`` showing only the sandbox; when its init exits the kernel kills
  everything left in it), mount, network (a down loopback: no network, no abstract unix sockets), IPC
  (SysV and POSIX queues) and UTS namespaces;
- files: the program sees a new root holding read-only binds of ``/usr``, ``/bin``, ``/sbin``, ``/lib*``,
  ``/etc`` and the interpreter's prefix, a minimal ``/dev``, and fresh tmpfs on ``/tmp``, ``/var/tmp``,
  ``/dev/shm``, ``/run/lock`` and its working directory (``disk_mb`` each). Nothing else of the host exists
  there (no run directory, dataset, ``/home``, ``/root``, host ``/tmp``); the launch directory and
  ``hide_paths`` that lie inside a bound tree are covered by an empty tmpfs, and one that holds the
  interpreter is an error, not a skip;
- identity: a uid of its own per sandbox (no passwd entry, no groups, ``no_new_privs``), taken from a
  rotating range so a finished sandbox's uid is not the next one's;
- limits per sandbox: a cgroup (v2, or v1 ``memory``/``pids``/``cpuacct``) bounds the memory
  (``memory_mb``, no swap) and processes (``max_processes``) of all its processes together, and its CPU
  time is polled here (``cpu_s`` per test); per process, RLIMIT_CPU/AS/FSIZE/NOFILE; wall time per test;
- nothing survives it: the pid namespace dies with the sandbox, the cgroup is emptied and removed (a
  worker SIGKILLed mid-test leaves one that the next sandbox on the machine sweeps), the tmpfs vanish
  with the mount namespace, captured output is in unlinked files.

**Not root, or without a cgroup**, the sandbox is weak: not root, the program runs as the user in a new
user and network namespace with per-process limits only, sees the whole filesystem as the user does,
other processes in ``/proc``, the host's ``/tmp`` and IPC (``hide_paths`` are then an error); as root
without a cgroup the memory and CPU limits are per process. :func:`check_sandbox` refuses ``reward=code``
at launch on such a machine unless ``reward.kwargs.allow_weak_sandbox`` is true (``allow_network_fallback``
alone only forgives a missing network namespace).
"""

from __future__ import annotations

import ast
import builtins
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from relax_rewards.registry import register

_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# uids of root-mode sandboxes: base + pid * slots + slot is unique among live processes (pid_max <= 2**22);
# the slot rotates, so a uid comes back only after _UID_SLOTS other sandboxes of this process
_UID_BASE, _UID_SLOTS = 100_000_000, 512
_uid_lock = threading.Lock()
_uids_in_use: set[int] = set()
_uid_next = itertools.count()
_cgroup_seq = itertools.count()
# the new root's read-only trees (the interpreter's prefix is added when outside them)
_SYSTEM_TREES = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_CGROUP_PREFIX = "relax-code-"

# Runs as the caller's user with the request on stdin (sent once this process is in its cgroup): the
# namespaces, then (as root) pid 1 of the new pid namespace builds the new root and runs each stage as the
# sandbox uid, one after another, printing a JSON status line per stage and a last one (or an error line).
_BOOT = r"""
import ctypes, fcntl, json, os, resource, signal, sys, time
a = json.loads(sys.stdin.buffer.read())
libc = ctypes.CDLL(None, use_errno=True)
root = a["root"]
def report(st):
    os.write(1, (json.dumps(st) + "\n").encode())
    os._exit(0)
def fail(msg):
    report({"error": msg + ": " + os.strerror(ctypes.get_errno())})
NEWNS, NEWUTS, NEWIPC, NEWUSER = 0x20000, 0x4000000, 0x8000000, 0x10000000
NEWPID, NEWNET = 0x20000000, 0x40000000
if root:
    if libc.unshare(NEWNS | NEWUTS | NEWIPC | NEWPID | NEWNET) != 0:
        fail("cannot make the sandbox's namespaces (mount, pid, net, ipc, uts)")
    netns = True
    init = os.fork()
    if init:
        os.waitpid(init, 0)
        os._exit(0)
    RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
    def mount(src, dst, fstype, flags, data=None):
        enc = lambda s: s.encode() if s is not None else None
        if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
            fail("cannot mount " + (fstype or src or "") + " on " + dst)
    mount(None, "/", None, REC | PRIVATE)
    R = "/tmp"  # the new root, a tmpfs shadowing the host's /tmp in this mount namespace only
    mount("tmpfs", R, "tmpfs", NOSUID | NODEV, "size=1m,mode=0755")
    for top, link in a["binds"]:
        if link is not None:
            os.symlink(link, R + top)
            continue
        os.makedirs(R + top)
        mount(top, R + top, None, BIND | REC)
        mount(None, R + top, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
    for path, is_dir in a["hide"]:
        if is_dir:
            mount("tmpfs", R + path, "tmpfs", RDONLY | NOSUID | NODEV, "size=4k,mode=0555")
        else:
            mount("/dev/null", R + path, None, BIND)
    os.makedirs(R + "/proc")
    mount("proc", R + "/proc", "proc", NOSUID | NODEV | NOEXEC, "hidepid=2")
    os.makedirs(R + "/dev")
    mount("tmpfs", R + "/dev", "tmpfs", NOSUID, "size=64k,mode=0755")
    for dev in ("null", "zero", "full", "random", "urandom"):
        open(R + "/dev/" + dev, "w").close()
        mount("/dev/" + dev, R + "/dev/" + dev, None, BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, R + "/dev/" + name)
    for tmp in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
        os.makedirs(R + tmp, exist_ok=True)
        mount("tmpfs", R + tmp, "tmpfs", NOSUID | NODEV, "size=%dk,mode=1777" % a["disk_kb"])
    os.makedirs(R + a["cwd"])
    mount("tmpfs", R + a["cwd"], "tmpfs", NOSUID | NODEV,
          "size=%dk,mode=0700,uid=%d,gid=%d" % (a["disk_kb"], a["uid"], a["uid"]))
    os.chroot(R)
    os.chdir("/")
else:
    netns = libc.unshare(NEWUSER | NEWNET) == 0
    if not netns and not a["allow_network"]:
        fail("no network namespace")
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: escaped descendants come back here to be reaped
def kill_rest(pid):
    try:
        os.kill(-1, signal.SIGKILL) if root else os.killpg(pid, signal.SIGKILL)  # root: all but pid 1
    except OSError:
        pass
def reap():
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, 0 if root else os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
def run(stage):
    req = os.memfd_create("request")
    data = stage["request"].encode()
    while data:
        data = data[os.write(req, data):]
    os.lseek(req, 0, os.SEEK_SET)
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            fds = stage["fds"]  # stdin, stdout, stderr, then the request on 3 and the results on 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in (*fds[:3], req, fds[3])]
            for to, fd in enumerate(high):
                os.dup2(fd, to)
            os.closerange(5, 1 << 16)
            for name, soft, hard in stage["limits"]:
                resource.setrlimit(getattr(resource, name), (soft, hard))
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
            if root:
                os.setgroups([])
                os.setgid(a["uid"])
                os.setuid(a["uid"])
            os.chdir(a["cwd"])
            os.execve(a["argv"][0], a["argv"], a["env"])
        finally:
            os._exit(127)
    os.close(req)
    st = {"timed_out": False}
    def on_alarm(*_):
        st["timed_out"] = True
        kill_rest(pid)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, stage["wall_s"])
    _, status = os.waitpid(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    st["returncode"] = os.waitstatus_to_exitcode(status)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
        st["timed_out"] = True  # the CPU-time limit: the same verdict as the wall clock's
    kill_rest(pid)  # what the stage left running does not see the next one
    reap()
    return st
for stage in a["stages"]:  # a line per stage: a sandbox killed for CPU time keeps the stages it finished
    os.write(1, (json.dumps({"stage": run(stage)}) + "\n").encode())
report({"netns": netns})
"""

# The program's side, run as the sandbox uid with ``python -I -S -c``: fd 3 holds the request (program,
# leaves), fd 4 takes one JSON line per leaf. Mode "run": just the program (stdin/stdout tests); "leaves":
# the program, then its leaves; "label": the label's own leaves, without the program.
_HARNESS = r"""
def _main():
    import json, os, signal, sys, traceback, types
    with os.fdopen(3, "rb") as f:
        req = json.loads(f.read())
    out = os.fdopen(4, "w")
    # bound before the program runs; whatever else it patches only changes the values it reports itself
    type_, repr_ = type, repr
    scalar = (type(None), bool, int, float, str)
    def enc(v, depth=0):
        t = type_(v)
        if depth > 64:
            raise ValueError("nested too deep")
        if t in scalar:
            return v
        if t is bytes:
            return {"b": v.hex()}
        if t is list:
            return [enc(x, depth + 1) for x in v]
        tag = {tuple: "t", set: "s", frozenset: "z"}.get(t)
        if tag:
            return {tag: [enc(x, depth + 1) for x in v]}
        if t is dict:
            return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
        raise TypeError("a value of type " + t.__name__ + " is not plain data")
    class Timeout(BaseException):
        pass
    def on_alarm(*_):
        raise Timeout()
    def evaluate(leaves, ns):
        for i, src in enumerate(leaves):
            signal.signal(signal.SIGALRM, on_alarm)
            signal.setitimer(signal.ITIMER_REAL, req["wall_s"])
            try:
                line = {"i": i, "v": enc(eval(compile(src, "<test>", "eval"), ns))}
            except Timeout:
                line = {"i": i, "timeout": True}
            except BaseException as e:
                line = {"i": i, "error": repr_(e)[:200]}
            signal.setitimer(signal.ITIMER_REAL, 0)
            out.write(json.dumps(line) + "\n")
            out.flush()
    if req["mode"] == "label":
        for name in req["modules"]:
            __import__(name)
        evaluate(req["leaves"], {name: sys.modules[name] for name in req["modules"]})
        os._exit(0)
    module = types.ModuleType("__main__")
    module.__file__ = "main.py"
    sys.modules["__main__"] = module
    sys.argv = ["main.py"]
    code = compile(req["program"], "main.py", "exec")
    if req["mode"] == "run":
        exec(code, module.__dict__)
        return
    try:
        exec(code, module.__dict__)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    evaluate(req["leaves"], module.__dict__)
    sys.stdout.flush()
    os._exit(0)
_main()
"""


@dataclass
class SandboxResult:
    """What one sandboxed run did: exit code (negative: killed by that signal), captured output, whether
    a wall-time or CPU-time limit killed it, and ``error`` when the sandbox itself could not be set up.
    ``weak`` names what this sandbox lacked of full isolation (empty: nothing)."""

    returncode: int | None
    stdout: str
    stderr: str
    timed_out: bool
    netns: bool
    error: str | None = None
    weak: tuple[str, ...] = ()
    results: list[dict[str, Any]] = field(default_factory=list)


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
    allow_weak_sandbox: bool = False
    hide_paths: tuple[str, ...] = ()


@dataclass
class _Stage:
    mode: str  # "run", "leaves" or "label" (see _HARNESS)
    request: dict[str, Any]
    stdin: str = ""
    tests: int = 1  # tests it stands for: its share of the sandbox's CPU and wall time


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


def _new_root(python: str, hide_paths: tuple[str, ...]) -> tuple[list[list[Any]], list[list[Any]]]:
    """The read-only trees of the sandbox's root (path, symlink target or None) and the paths to cover in it
    (path, is a folder). A hide that would cover the interpreter is a ValueError naming both."""
    exe = Path(python).resolve()
    trees = [Path(t) for t in _SYSTEM_TREES if os.path.lexists(t)]
    prefix = exe.parents[1]
    if not any(prefix.is_relative_to(t.resolve()) for t in trees if not t.is_symlink()):
        if prefix == Path("/"):
            raise ValueError(f"reward=code: the interpreter {exe} has no prefix folder to bind")
        trees.append(prefix)
    binds = [[str(t), os.readlink(t) if t.is_symlink() else None] for t in trees]
    real_trees = [t.resolve() for t in trees if not t.is_symlink()]
    hide = []
    for p in (*hide_paths, os.getcwd()):
        path = Path(p).resolve()
        if exe.is_relative_to(path):
            raise ValueError(f"reward=code: cannot hide {path}: the sandbox's interpreter {exe} is inside it")
        if path.exists() and any(path.is_relative_to(t) for t in real_trees):
            hide.append([str(path), path.is_dir()])  # elsewhere it is simply absent from the new root
    return binds, hide


class _Cgroup:
    """One sandbox's cgroup: cgroup v2 where this process's cgroup delegates memory, pids and cpu, else v1
    ``memory``/``pids``/``cpuacct`` children of this process's own cgroups. Named after the pid that made
    it, so a sandbox of a SIGKILLed worker is swept by the next one made on the machine."""

    def __init__(self, dirs: dict[str, Path], v2: bool) -> None:
        self.dirs, self.v2 = dirs, v2

    @classmethod
    def create(cls, memory_bytes: int, max_pids: int) -> _Cgroup | None:
        name = f"{_CGROUP_PREFIX}{os.getpid()}-{next(_cgroup_seq)}"
        for v2, parents in ((True, _v2_parent()), (False, _v1_parents())):
            if not parents:
                continue
            _sweep(parents)
            cg = cls({c: p / name for c, p in parents.items()}, v2)
            try:
                for d in cg.dirs.values():
                    d.mkdir()
                if v2:
                    cg._write("memory", "memory.max", memory_bytes)
                    cg._write("memory", "memory.swap.max", 0, optional=True)
                    cg._write("pids", "pids.max", max_pids)
                else:
                    cg._write("memory", "memory.limit_in_bytes", memory_bytes)
                    cg._write("memory", "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                    cg._write("pids", "pids.max", max_pids)
                return cg
            except OSError:
                cg.remove()
        return None

    def _write(self, ctrl: str, name: str, value: int, optional: bool = False) -> None:
        try:
            (self.dirs[ctrl] / name).write_text(str(value))
        except OSError:
            if not optional:
                raise

    def add(self, pid: int) -> None:
        for d in {*self.dirs.values()}:
            (d / "cgroup.procs").write_text(str(pid))

    def cpu_s(self) -> float:
        try:
            if self.v2:
                stat = (self.dirs["cpu"] / "cpu.stat").read_text().split()
                return int(stat[stat.index("usage_usec") + 1]) / 1e6
            return int((self.dirs["cpu"] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return 0.0

    def hit_memory_limit(self) -> bool:
        """Whether the kernel OOM-killed in this cgroup (the kill may take the boot process itself: the
        program's tests then fail, the sandbox did its job)."""
        try:
            if self.v2:
                events = (self.dirs["memory"] / "memory.events").read_text().split()
                return int(events[events.index("oom_kill") + 1]) > 0
            # v1 counts OOM kills in memory.oom_control (memory.failcnt stays 0 on an OOM kill)
            fields = (self.dirs["memory"] / "memory.oom_control").read_text().split()
            return int(fields[fields.index("oom_kill") + 1]) > 0
        except (OSError, ValueError):
            return False

    def remove(self) -> None:
        """Kill every process still in it, then remove it (retrying while the dead are being reaped)."""
        _remove_cgroup(list({*self.dirs.values()}))


def _v2_parent() -> dict[str, Path]:
    mount = Path("/sys/fs/cgroup")
    try:
        if not {"memory", "pids", "cpu"} <= set((mount / "cgroup.controllers").read_text().split()):
            return {}
        own = next(
            ln[3:] for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.startswith("0::")
        )
    except (OSError, StopIteration):
        return {}
    # under this process's cgroup where it can delegate the controllers, else beside it (a cgroup holding
    # processes cannot give its children controllers: cgroup v2's no-internal-process rule)
    for parent in (mount / own.lstrip("/"), (mount / own.lstrip("/")).parent):
        try:
            (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        except OSError:
            continue
        return {"memory": parent, "pids": parent, "cpu": parent}
    return {}


def _v1_parents() -> dict[str, Path]:
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, ctrls, path = line.split(":", 2)
            for c in ctrls.split(","):
                own[c] = path
    except (OSError, ValueError):
        return {}
    parents = {}
    for key, ctrl in (("memory", "memory"), ("pids", "pids"), ("cpu", "cpuacct")):
        d = Path("/sys/fs/cgroup") / ctrl / own.get(ctrl, "/").lstrip("/")
        if ctrl not in own or not os.access(d, os.W_OK):
            return {}
        parents[key] = d
    return parents


def _remove_cgroup(dirs: list[Path]) -> None:
    deadline = time.monotonic() + 5.0
    while dirs and time.monotonic() < deadline:
        for d in list(dirs):
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
                d.rmdir()
                dirs.remove(d)
            except FileNotFoundError:
                dirs.remove(d)
            except OSError:
                pass
        if dirs:
            time.sleep(0.01)


def _sweep(parents: dict[str, Path]) -> None:
    """Remove the cgroups of sandboxes whose maker is gone (a worker SIGKILLed mid-test)."""
    for d in {*parents.values()}:
        try:
            names = [n for n in os.listdir(d) if n.startswith(_CGROUP_PREFIX)]
        except OSError:
            continue
        for n in names:
            try:
                os.kill(int(n[len(_CGROUP_PREFIX) :].split("-")[0]), 0)
            except ProcessLookupError:
                _remove_cgroup([d / n])
            except (ValueError, OSError):
                pass


def _take_uid() -> int:
    with _uid_lock:
        for _ in range(_UID_SLOTS):
            uid = _UID_BASE + os.getpid() * _UID_SLOTS + next(_uid_next) % _UID_SLOTS
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid
    raise RuntimeError(f"reward=code: more than {_UID_SLOTS} sandboxes at once in one process")


def _read_capped(f: IO[bytes], limit: int) -> str:
    f.seek(0)
    return f.read(limit).decode("utf-8", "replace")


def _run_stages(stages: list[_Stage], limits: SandboxLimits) -> tuple[list[SandboxResult], str | None]:
    """Run ``stages`` one after another in one sandbox; one result per stage (``results``: the JSON lines
    it wrote on fd 4), or an error when the sandbox could not be built."""
    root = os.geteuid() == 0
    python = sandbox_python()
    weak = [] if root else ["not root"]
    if not root and limits.hide_paths:
        raise ValueError("reward=code: hide_paths need root (the sandbox hides nothing as another user)")
    binds, hide = _new_root(python, limits.hide_paths) if root else ([], [])
    uid = _take_uid() if root else os.getuid()
    work = "/sandbox" if root else tempfile.mkdtemp(prefix="relax-code-")
    out_cap = limits.output_kb * 1024
    cpu = max(1, round(limits.cpu_s))
    files: list[list[IO[bytes]]] = []
    cgroup = None
    try:
        cgroup = _Cgroup.create(limits.memory_mb << 20, limits.max_processes + 2) if root else None
        if root and cgroup is None:
            weak.append("no cgroup")
        for s in stages:
            fs = [tempfile.TemporaryFile() for _ in range(4)]  # stdin, stdout, stderr, results: unlinked
            fs[0].write(s.stdin.encode())
            fs[0].seek(0)
            files.append(fs)
        args = {
            "root": root,
            "uid": uid,
            "cwd": work,
            "binds": binds,
            "hide": hide,
            "disk_kb": limits.disk_mb * 1024,
            "allow_network": bool(limits.allow_network_fallback or limits.allow_weak_sandbox),
            "argv": [python, "-I", "-S", "-c", _HARNESS],
            "env": {
                "PATH": "/usr/bin:/bin",
                "HOME": work,
                "TMPDIR": "/tmp" if root else work,
                "LANG": "C.UTF-8",
            },
            "stages": [
                {
                    "request": json.dumps({**s.request, "mode": s.mode, "wall_s": float(limits.wall_s)}),
                    "fds": [f.fileno() for f in fs],
                    "wall_s": float(limits.wall_s) * s.tests,
                    "limits": [
                        ("RLIMIT_CPU", cpu * s.tests, cpu * s.tests + 1),
                        ("RLIMIT_AS", limits.memory_mb << 20, limits.memory_mb << 20),
                        ("RLIMIT_FSIZE", out_cap, out_cap),
                        ("RLIMIT_NPROC", limits.max_processes, limits.max_processes),
                        ("RLIMIT_NOFILE", limits.max_open_files, limits.max_open_files),
                        ("RLIMIT_CORE", 0, 0),
                    ],
                }
                for s, fs in zip(stages, files, strict=True)
            ],
        }
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=[f.fileno() for fs in files for f in fs],
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        if cgroup is not None:
            cgroup.add(proc.pid)  # before it reads its request: everything it starts is in the cgroup
        boot_out, boot_err, cpu_killed = _wait(proc, json.dumps(args).encode(), cgroup, stages, limits)
        if cpu_killed is None:
            return [], "sandbox process did not finish"
        lines = [json.loads(ln) for ln in boot_out.decode(errors="replace").splitlines() if ln.strip()]
        oom_killed = not lines and cgroup is not None and cgroup.hit_memory_limit()
        if not lines and not cpu_killed and not oom_killed:
            err = boot_err.decode(errors="replace").strip().splitlines()
            return [], f"sandbox failed: {err[-1] if err else proc.returncode}"
        if lines and lines[-1].get("error"):
            return [], lines[-1]["error"]
        done = [ln["stage"] for ln in lines if "stage" in ln]
        netns = bool(lines[-1].get("netns", root)) if lines else root
        results = []
        for i, fs in enumerate(files):
            # a stage that never reported was killed with the sandbox: for CPU time, or by an OOM kill
            s = done[i] if i < len(done) else {"returncode": None, "timed_out": bool(cpu_killed)}
            results.append(
                SandboxResult(
                    s["returncode"],
                    _read_capped(fs[1], out_cap),
                    _read_capped(fs[2], out_cap),
                    bool(s["timed_out"]),
                    netns,
                    weak=tuple(weak) + (() if netns else ("no network namespace",)),
                    results=_result_lines(fs[3], out_cap),
                )
            )
        return results, None
    finally:
        if cgroup is not None:
            cgroup.remove()
        for fs in files:
            for f in fs:
                f.close()
        if not root:
            shutil.rmtree(work, ignore_errors=True)
        else:
            with _uid_lock:
                _uids_in_use.discard(uid)


def _wait(
    proc: subprocess.Popen[bytes],
    request: bytes,
    cgroup: _Cgroup | None,
    stages: list[_Stage],
    limits: SandboxLimits,
) -> tuple[bytes, bytes, bool | None]:
    """Send the request, then wait for the sandbox, killing it when the cgroup's CPU time passes the
    sandbox's budget (cpu_s per test) or, as a backstop, its wall time. (stdout, stderr, killed for CPU),
    killed None when only the backstop ended it."""
    tests = sum(s.tests for s in stages)
    cpu_budget = limits.cpu_s * tests + 0.2 * len(stages)  # + each interpreter's start-up
    deadline = time.monotonic() + limits.wall_s * tests + 10.0
    assert proc.stdin is not None
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    cpu_killed: bool | None = False
    while True:
        try:
            proc.wait(timeout=0.05)
            break
        except subprocess.TimeoutExpired:
            over = cgroup is not None and cgroup.cpu_s() > cpu_budget
            if over or time.monotonic() > deadline:
                cpu_killed = True if over else None
                if cgroup is not None:
                    cgroup.remove()  # the boot process and the sandbox's init die with the rest
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert proc.stdout is not None and proc.stderr is not None
    return proc.stdout.read(), proc.stderr.read(), cpu_killed


def _result_lines(f: IO[bytes], limit: int) -> list[dict[str, Any]]:
    out = []
    for raw in _read_capped(f, limit).splitlines():
        try:
            line = json.loads(raw)
        except (ValueError, RecursionError):  # the program may write anything there
            continue
        if isinstance(line, dict) and type(line.get("i")) is int:
            out.append(line)
    return out


def run_sandboxed(program: str, stdin: str = "", limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``program`` with ``python -I -S`` in a sandbox (see the module doc) and capture its output."""
    try:
        results, error = _run_stages([_Stage("run", {"program": program}, stdin)], limits)
    except ValueError as err:
        return SandboxResult(None, "", "", False, False, str(err))
    if error:
        return SandboxResult(None, "", "", False, False, error)
    return results[0]


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


# --- asserts: the skeleton evaluated here, the leaves there ---------------------------------------------

_MAX_REPEAT = 1 << 20


def _mul(a: Any, b: Any) -> Any:
    for seq, n in ((a, b), (b, a)):
        if isinstance(seq, str | bytes | list | tuple) and isinstance(n, int) and n * len(seq) > _MAX_REPEAT:
            raise ValueError("product too large")
    return a * b


def _pow(a: Any, b: Any) -> Any:
    if isinstance(b, int) and abs(b) > 4096:
        raise ValueError("exponent too large")
    return a**b


# what a skeleton may call: evaluated here on the sandbox's plain values
_FUNCS: dict[str, Any] = {
    name: getattr(builtins, name)
    for name in (
        "abs all any bool bytes dict float frozenset int isinstance len list max min round set sorted str sum "
        "tuple type"
    ).split()
}
_FUNCS |= {"math.isclose": math.isclose, "__mul": _mul, "__pow": _pow}
_TYPES = {n: _FUNCS[n] for n in "bool bytes dict float frozenset int list set str tuple".split()}
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


@dataclass
class AssertPlan:
    """The asserts of one label split for :func:`code_reward`: per assert the compiled skeletons of its
    ``assert`` statements; the leaves the program evaluates, and the label's own (``label_leaves``) with
    the stdlib modules they name."""

    skeletons: list[list[Any]]
    program_leaves: list[str]
    label_leaves: list[str]
    modules: list[str]
    uses: list[list[str]]  # per assert: the leaf names ("p3", "l0") its skeletons read


def _free_names(node: ast.AST) -> tuple[set[str], set[str]]:
    """(names read, names used only as ``name.attr``) of an expression, minus those it binds itself."""
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    bound |= {
        a.arg
        for n in ast.walk(node)
        if isinstance(n, ast.Lambda)
        for a in ast.walk(n.args)
        if isinstance(a, ast.arg)
    }
    attr_bases = {
        id(n.value) for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
    }
    names, bases = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound:
            (bases if id(n) in attr_bases else names).add(n.id)
    return names, bases - names


class _Splitter(ast.NodeTransformer):
    """Turns an assert's test into its skeleton: literals stay, leaves become ``__p<k>``/``__l<k>`` names."""

    def __init__(self, program: dict[str, int], label: dict[str, int], modules: set[str]) -> None:
        self.program, self.label, self.modules = program, label, modules
        self.used: set[str] = set()

    def leaf(self, node: ast.expr) -> ast.expr:
        src = ast.unparse(node)
        names, bases = _free_names(node)
        own = names <= set(dir(builtins)) and bases <= sys.stdlib_module_names
        table, tag = (self.label, "l") if own else (self.program, "p")
        if own:
            self.modules |= bases
        key = f"__{tag}{table.setdefault(src, len(table))}"
        self.used.add(key)
        return ast.copy_location(ast.Name(key, ast.Load()), node)

    def visit(self, node: ast.AST) -> ast.AST:
        if not isinstance(node, ast.expr):
            return node  # operators, contexts
        try:
            ast.literal_eval(node)
            return node
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
        if isinstance(node, ast.Compare | ast.BoolOp) or (
            isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not | ast.USub | ast.UAdd)
        ):
            return self.generic_visit(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, _BINOPS):
            left, right = self.visit(node.left), self.visit(node.right)
            if isinstance(node.op, ast.Mult | ast.Pow):
                fn = "__mul" if isinstance(node.op, ast.Mult) else "__pow"
                return ast.copy_location(ast.Call(ast.Name(fn, ast.Load()), [left, right], []), node)
            return ast.copy_location(ast.BinOp(left, node.op, right), node)
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            return self.generic_visit(node)
        if isinstance(node, ast.Name) and node.id in _TYPES:
            return node
        if isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args):
            fname = ast.unparse(node.func)
            if (
                fname in _FUNCS
                and not fname.startswith("__")
                and (fname == "math.isclose" or not node.keywords)
            ):
                func = ast.Name(fname.replace(".", "_") if "." in fname else fname, ast.Load())
                args = [self.visit(a) for a in node.args]
                kws = [ast.keyword(k.arg, self.visit(k.value)) for k in node.keywords if k.arg]
                if len(kws) == len(node.keywords):
                    return ast.copy_location(ast.Call(func, args, kws), node)
        return self.leaf(node)


def plan_asserts(asserts: list[str]) -> AssertPlan:
    """Split ``asserts`` (each one or more ``assert`` statements) into skeletons and leaves; a line that is
    not assert statements, or does not parse, is a ValueError naming it."""
    program: dict[str, int] = {}
    label: dict[str, int] = {}
    modules: set[str] = set()
    skeletons, uses = [], []
    for text in asserts:
        try:
            body = ast.parse(text).body
        except SyntaxError as err:
            raise ValueError(f"code reward: assert {text!r} does not parse: {err.msg}") from None
        if not body or not all(isinstance(s, ast.Assert) for s in body):
            raise ValueError(f"code reward: {text!r} is not a line of assert statements")
        splitter = _Splitter(program, label, modules)
        skeletons.append(
            [
                compile(ast.fix_missing_locations(ast.Expression(splitter.visit(s.test))), "<assert>", "eval")
                for s in body
            ]  # type: ignore[union-attr]
        )
        uses.append(sorted(splitter.used))
    return AssertPlan(skeletons, list(program), list(label), sorted(modules), uses)


def _decode(x: Any) -> Any:
    """A value from the sandbox's encoder, as plain data; anything else is a ValueError."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is list:
        return [_decode(v) for v in x]
    if type(x) is dict and len(x) == 1:
        ((tag, v),) = x.items()
        if tag == "b" and type(v) is str:
            return bytes.fromhex(v)
        if type(v) is list:
            if tag in ("t", "s", "z"):
                return {"t": tuple, "s": set, "z": frozenset}[tag](_decode(e) for e in v)
            if tag == "d" and all(type(kv) is list and len(kv) == 2 for kv in v):
                return {_decode(k): _decode(e) for k, e in v}
    raise ValueError("not a plain value")


def _values(lines: list[dict[str, Any]], prefix: str, n: int) -> tuple[dict[str, Any], set[str]]:
    """The decoded leaf values (first line per leaf wins) and the leaves that timed out."""
    values: dict[str, Any] = {}
    timeouts: set[str] = set()
    for line in lines:
        key = f"__{prefix}{line['i']}"
        if not 0 <= line["i"] < n or key in values or key in timeouts:
            continue
        if line.get("timeout") is True:
            timeouts.add(key)
        elif "v" in line:
            try:
                values[key] = _decode(line["v"])
            except (ValueError, TypeError, RecursionError):
                pass
    return values, timeouts


def _holds(skeleton: Any, values: dict[str, Any]) -> bool:
    env = {**_FUNCS, "math_isclose": math.isclose, **values}
    try:
        return bool(eval(skeleton, {"__builtins__": {}}, env))  # noqa: S307 - only the node types _Splitter keeps
    except Exception:  # noqa: BLE001 - a skeleton that fails on the program's values is a failed assert
        return False


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
    wall-time or CPU-time limit). A sandbox that cannot be set up (see :func:`check_sandbox`) raises, so
    the sample is a counted reward error, not a silent 0; so does an assert that is not assert statements.
    """
    cases, asserts = _tests(label)
    program = extract_program(response)
    sandbox = sandbox_limits(limits)
    plan = plan_asserts(asserts)
    stages = []
    if plan.label_leaves:
        stages.append(_Stage("label", {"leaves": plan.label_leaves, "modules": plan.modules}))
    stages += [_Stage("run", {"program": program}, c.get("stdin") or "") for c in cases]
    if asserts:
        stages.append(
            _Stage("leaves", {"program": program, "leaves": plan.program_leaves}, tests=len(asserts))
        )
    results, error = _run_stages(stages, sandbox)
    if error:
        raise RuntimeError(f"code reward sandbox: {error}")
    if not _weak_allowed(results[0].weak, sandbox):
        raise RuntimeError(f"code reward: weak sandbox ({', '.join(results[0].weak)}) not allowed")
    passed = timeouts = 0
    label_res = results.pop(0) if plan.label_leaves else None
    for res, case in zip(results, cases, strict=False):
        timeouts += res.timed_out
        passed += res.returncode == 0 and not res.timed_out and _same_output(res.stdout, str(case["stdout"]))
    if asserts:
        res = results[-1]
        # a program that exits or dies before the harness evaluates its leaves leaves them without values
        values, late = _values(res.results, "p", len(plan.program_leaves))
        if label_res is not None:
            values |= _values(label_res.results, "l", len(plan.label_leaves))[0]
        for skeletons, used in zip(plan.skeletons, plan.uses, strict=True):
            if all(k in values for k in used):
                passed += all(_holds(s, values) for s in skeletons)
            else:
                timeouts += res.timed_out or any(k in late for k in used)
    n = len(cases) + len(asserts)
    rate = passed / n
    all_passed = float(passed == n)
    return {
        "score": all_passed if all_or_nothing else rate,
        "pass_rate": rate,
        "all_passed": all_passed,
        "num_tests": float(n),
        "timeouts": float(timeouts),
    }


def _weak_allowed(weak: tuple[str, ...], limits: SandboxLimits) -> bool:
    return (
        not weak
        or limits.allow_weak_sandbox
        or (weak == ("no network namespace",) and limits.allow_network_fallback)
    )


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
    """Launch check: ValueError in one line when the sandbox cannot start here, or when it would be weak
    (not root, no cgroup, no network namespace: see the module doc) and ``reward.kwargs.allow_weak_sandbox``
    is not set (``allow_network_fallback`` forgives only a missing network namespace)."""
    limits = sandbox_limits({k: v for k, v in kwargs.items() if k != "all_or_nothing"})  # unknown keys
    probe = SandboxLimits(wall_s=10.0, allow_weak_sandbox=True, hide_paths=limits.hide_paths)
    res = run_sandboxed("print(1)", limits=probe)
    if res.error or res.returncode != 0:
        raise ValueError(
            f"reward=code: the sandbox cannot run a program here: {res.error or res.stderr.strip()[-200:]}"
        )
    if not _weak_allowed(res.weak, limits):
        raise ValueError(
            f"reward=code: this machine gives sandboxed programs only a weak sandbox ({', '.join(res.weak)}: "
            "they could read labels, other samples and run files, or outlive their limits); run as root with "
            "cgroups, or set reward.kwargs.allow_weak_sandbox=true to accept it"
        )


register("code", key="score", needs_label=True, check=check_sandbox)(code_reward)
