"""Folders built once and kept in the user cache (``$RELAX_CACHE_DIR`` or ``~/.cache/relax``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("RELAX_CACHE_DIR") or "~/.cache/relax").expanduser()


def build_once(folder: Path, is_built: Callable[[Path], bool], build: Callable[[Path], None]) -> Path:
    """``folder``, first built by ``build(scratch)`` unless ``is_built(folder)``.

    The build goes to a temporary sibling renamed into place, so concurrent launches never see half a
    folder; when one of them finishes first, the others keep its folder and drop their own.
    """
    if is_built(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        build(scratch)
        scratch.chmod(0o755)  # mkdtemp's 0700 would be copied along with the folder
        if folder.exists() and not is_built(folder):  # a stale or different build
            shutil.rmtree(folder)
        scratch.rename(folder)
    except OSError:
        if not is_built(folder):  # not a concurrent build that finished first
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder
