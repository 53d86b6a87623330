"""Built-in verifiers; importing this package registers them."""

from relax_rewards.builtin import (  # noqa: F401
    dapo,
    deepscaler,
    f1,
    genrm,
    gpqa,
    ifeval,
    math,
    multiple_choice,
    openr1mm,
    remote,
)
