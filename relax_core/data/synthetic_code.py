"""``data.synthetic=code_tiny``: a tiny code task for ``reward=code`` (tests and smoke runs, not learning).

Each row asks for a small Python program; its label holds the tests in the code reward's shape:
stdin/stdout cases for the read-and-print rows, assert lines for the function rows.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from relax_core.data.synthetic import synthetic_task

if TYPE_CHECKING:
    from relax_core.config.schema import DataConfig

_OPS = {"add": lambda n, k: n + k, "mul": lambda n, k: n * k, "mod": lambda n, k: n % k}
_SIGN = {"add": "+", "mul": "*", "mod": "%"}


@synthetic_task("code_tiny")
def code_row(rng: random.Random, cfg: DataConfig) -> dict:
    """``py: print n+7 for the n on stdin`` or ``py: def f(n): n*3``, with three tests of random n."""
    op = rng.choice(sorted(_OPS))
    k = rng.randint(1, 99)
    ns = [rng.randint(0, 999) for _ in range(3)]
    if rng.random() < 0.5:
        prompt = f"py: print n{_SIGN[op]}{k} for the n on stdin"
        label = {"tests": [{"stdin": f"{n}\n", "stdout": str(_OPS[op](n, k))} for n in ns]}
    else:
        prompt = f"py: def f(n): return n{_SIGN[op]}{k}"
        label = {"asserts": [f"assert f({n}) == {_OPS[op](n, k)}" for n in ns]}
    return {"prompt": prompt, "label": label, "metadata": {"task": "code"}}
