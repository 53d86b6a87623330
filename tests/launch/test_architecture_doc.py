"""docs/architecture.md names files a newcomer will open: each must exist (a rename or a move that forgets
the page fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("relax_launch", "relax_core", "relax_models", "relax_rewards", "benchmarks", "tests", "scripts")
SUBPACKAGES = (
    "algorithms",
    "backends",
    "databus",
    "engines",
    "modes",
    "roles",
    "weight_transfer",
    "runtime",
    "resilience",
    "telemetry",
    "evaluation",
    "data",
    "config",
    "preflight",
    "rollout",
    "cluster",
)


def named_files(text: str) -> set[str]:
    """Paths in backticks ending in .py: full ones (``relax_core/resilience/health.py``) and ones the page gives within
    their package (``weight_transfer/channel.py``, resolved against relax_core and relax_launch)."""
    return {m for m in re.findall(r"`([\w/]+\.py)`", text) if "/" in m}


def exists(path: str) -> bool:
    if path.split("/")[0] in PACKAGES:
        return (ROOT / path).is_file()
    if path.split("/")[0] in SUBPACKAGES:
        return any((ROOT / package / path).is_file() for package in ("relax_core", "relax_launch"))
    return False


def test_every_file_the_architecture_page_names_exists() -> None:
    files = named_files((ROOT / "docs" / "architecture.md").read_text())
    assert len(files) > 30, files  # the pattern still finds the page's paths
    missing = sorted(f for f in files if not exists(f))
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
