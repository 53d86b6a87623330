"""The package layers (relax_launch > relax_core > relax_models > relax_rewards) and no import cycles.

``lint-imports`` checks the contracts in pyproject.toml ([tool.importlinter]); the module-level check below
also catches a module importing a package that imports it back, which sibling contracts do not see.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("relax_rewards", "relax_models", "relax_core", "relax_launch")


def test_import_contracts_hold() -> None:
    lint = shutil.which("lint-imports")
    assert lint, "import-linter is not installed (it is in the `test` extra)"
    proc = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True)
    cycles = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.add(frozenset(back))  # the chain back runs from ``imported`` to ``importer``
    assert not cycles, "\n".join(" <-> ".join(sorted(c)) for c in cycles)
