"""Loading user rewards from a dotted path or a file, and the per-group marker."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

_GROUP_ATTR = "__relax_group_reward__"
# modules loaded from files: their names are not importable, so worker processes reload them by path
_FILE_MODULES: dict[str, Path] = {}


def group_reward(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` as a per-group reward: ``fn(responses, labels, metadatas) -> list`` for one prompt.

    Group rewards see all samples of a prompt together (e.g. to rank or deduplicate them).
    """
    setattr(fn, _GROUP_ATTR, True)
    return fn


def is_group_reward(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was marked with :func:`group_reward`."""
    return bool(getattr(fn, _GROUP_ATTR, False))


def is_file_target(target: str) -> bool:
    """``path/to/file.py:fn`` (a file) rather than ``pkg.mod.fn`` (an importable module)."""
    path, sep, _ = target.rpartition(":")
    return bool(sep) and (path.endswith(".py") or "/" in path or "\\" in path)


def _import_file(path_str: str, target: str) -> ModuleType:
    path = Path(path_str).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"custom reward {target!r}: file {str(path)!r} does not exist")
    # one module per file, named after its path, so loading twice reuses it
    mod_name = "relax_rewards_custom_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module = sys.modules.get(mod_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"custom reward {target!r}: cannot load {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
        _FILE_MODULES[mod_name] = path
    return module


def _load_file(target: str) -> Callable[..., Any]:
    path_str, _, attr = target.rpartition(":")
    if not attr:
        raise ValueError(f"custom reward {target!r}: missing function name after ':'")
    return _attr(_import_file(path_str, target), attr, target)


def file_target(fn: Callable[..., Any]) -> str | None:
    """``"path/file.py:name"`` for a function defined in a file loaded by this module, else None."""
    path = _FILE_MODULES.get(getattr(fn, "__module__", "") or "")
    return f"{path}:{fn.__qualname__}" if path is not None else None


def import_plugin(spec: str) -> ModuleType:
    """Import a plug-in module (``"pkg.module"`` or ``"path/to/file.py"``) so that the rewards it
    registers with ``@relax_rewards.register`` become available by name."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward plug-in must be a module name or a .py path, got {spec!r}")
    spec = spec.strip()
    if spec.endswith(".py") or "/" in spec or "\\" in spec:
        return _import_file(spec, spec)
    return importlib.import_module(spec)


def _attr(obj: Any, dotted: str, target: str) -> Any:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"custom reward {target!r}: {obj.__name__!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _load_dotted(target: str) -> Callable[..., Any]:
    parts = target.split(".")
    if len(parts) < 2 or not all(parts):
        raise ValueError(
            f"custom reward {target!r}: expected 'pkg.module.function' or 'path/file.py:function'"
        )
    # the longest importable prefix is the module; the rest are attributes (e.g. a class method)
    for cut in range(len(parts) - 1, 0, -1):
        mod_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name is not None and (mod_name == e.name or mod_name.startswith(e.name + ".")):
                continue  # this prefix (or a parent) is not a module; try a shorter one
            raise  # the module exists but one of its own imports is missing
        return _attr(module, ".".join(parts[cut:]), target)
    raise ModuleNotFoundError(f"custom reward {target!r}: no module {parts[0]!r} can be imported")


def load_custom(target: str) -> Callable[..., Any]:
    """Import a user reward from ``"pkg.mod.fn"`` (or ``"pkg.mod:fn"``) or ``"path/to/file.py:fn"``.

    The function may be per-sample ``fn(response, label, metadata=None)`` or per-group (marked with
    :func:`group_reward`), sync or ``async def``.
    """
    if not isinstance(target, str) or not target.strip():
        raise ValueError(f"custom reward target must be a non-empty string, got {target!r}")
    target = target.strip()
    if is_file_target(target):
        fn = _load_file(target)
    elif ":" in target:  # "pkg.mod:fn", the entry-point spelling
        mod_name, _, attr = target.partition(":")
        fn = _attr(importlib.import_module(mod_name), attr, target)
    else:
        fn = _load_dotted(target)
    if not callable(fn):
        raise TypeError(f"custom reward {target!r} is not callable (got {type(fn).__name__})")
    return fn
