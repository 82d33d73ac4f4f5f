"""How many requests ``arbor serve`` batches unless told (``--max-batch``), from the machine.

Light on purpose: the command line builds its ``--help`` from it before anything imports MLX
(``arbor app`` shows its window first), so MLX is imported only to ask for a GPU.
"""

from __future__ import annotations

import os

#: On a CPU every row of a step costs compute, so a core takes about 4 rows before each stream
#: falls under ~40% of its speed alone (arbor bench batch: 8 rows on 2 cores); a GPU takes rows
#: almost free up to the cap (mlx-lm's server's decode concurrency too).
ROWS_PER_CORE = 4
FEWEST, MOST = 4, 32


def usable_cpus() -> int:
    """The cores this process may run on (a container's or ``taskset``'s share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def default_max_batch(cpus: int | None = None, gpu: bool | None = None) -> int:
    """On a GPU the most; on a CPU ``ROWS_PER_CORE`` per usable core, between the fewest and
    the most. ``gpu=None`` asks MLX where it runs."""
    if gpu is None:
        import mlx.core as mx

        gpu = mx.default_device().type == mx.DeviceType.gpu
    if gpu:
        return MOST
    cpus = usable_cpus() if cpus is None else cpus
    return max(FEWEST, min(MOST, ROWS_PER_CORE * cpus))
