"""Session-wide test setup: quiet, offline, single-threaded torch, Ctrl-C as in a terminal, one tiny model
folder (with its tokenizer and model) for everyone, and the quick tier (``--quick``, ``tests/tiers.py``).

Area-specific fixtures live in ``tests/<area>/conftest.py``; keep this file small. Tiny-model dimensions are
in ``tests/tiny_dims.py``; a test that runs ``python -m relax_launch`` does it through ``tests/launching.py``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiers
import torch
from tiny_dims import tiny_dims as default_tiny_dims

# offline and quiet in this process and every subprocess / Ray worker it starts
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
# Hugging Face datasets converted from the tests' files stay in a folder of this session, not the user's
# ~/.cache/huggingface (a test of a name in the hub cache builds its own cache there)
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="relax-tests-hf-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
# the shared 2-core machine: one intra-op thread keeps tests from fighting each other
torch.set_num_threads(1)
# a session started in the background of a non-interactive shell (`cmd &`) inherits SIGINT ignored, and
# so would every run it starts, which then never sees the Ctrl-C some tests send; a handled signal is back
# at its default in each child
signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--quick",
        action="store_true",
        help="the quick tier: leave out heavy tests (Ray, launches, Slurm, network namespaces; tests/tiers.py) "
        "and fail any test that starts one of those",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks each heavy test ``heavy`` (what it uses; ``-m "not heavy"`` selects the rest); ``--quick``
    deselects them."""
    quick, heavy = [], []
    for item in items:
        reasons = tiers.heavy_reasons(item)
        if reasons:
            item.add_marker(pytest.mark.heavy(*reasons))
        (heavy if reasons else quick).append(item)
    if config.getoption("quick"):
        config.hook.pytest_deselected(items=heavy)
        items[:] = quick


@pytest.fixture(autouse=True, scope="session")
def _quick_tier_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """In the quick tier, a test that starts Ray or launches a run or server fails (after collection:
    collecting may probe what a heavy test needs)."""
    if not request.config.getoption("quick"):
        yield
        return
    with tiers.guard():
        yield


@pytest.fixture
@tiers.heavy("launches `python -m relax_launch`")
def relax_launch_cmd() -> list[str]:
    """The command a user runs, for a test that launches it in a subprocess."""
    return [sys.executable, "-m", "relax_launch"]


@pytest.fixture
@tiers.heavy("starts Ray in the test (a launcher, a run)")
def ray_started_in_test() -> Iterator[None]:
    """For a test that starts Ray itself: shuts it down after the test."""
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_dims() -> dict:
    """Qwen3Config overrides of the default tiny model (``conf/model/tiny_qwen3.yaml``)."""
    return default_tiny_dims()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen3 + char tokenizer folder, built once (read-only for tests)."""
    from relax_models.tiny import build_tiny_qwen3

    return build_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"), seed=7, **default_tiny_dims())


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    """The tiny model's char tokenizer (no chat template)."""
    from relax_models.loader import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> torch.nn.Module:
    """The tiny model in eval mode, one per test module."""
    from relax_models.loader import load_causal_lm

    return load_causal_lm(str(tiny_model_dir)).eval()


@pytest.fixture(autouse=True, scope="module")
def _ray_down_after_module():
    """Each test module starts from no Ray: a module that leaves one running must not break the next."""
    yield
    ray = sys.modules.get("ray")  # a module that never imported Ray left none (the GPU machine has none)
    if ray is not None and ray.is_initialized():
        ray.shutdown()
