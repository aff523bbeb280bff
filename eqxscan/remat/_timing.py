"""Timing compiled steps: interleaved rounds, so that the machine's noise falls
evenly on every step (used by `fit_remat` and by the benchmarks)."""

import gc
import random
import time
from collections.abc import Callable, Mapping

import jax

from .._internal import check_size


def time_interleaved(
    steps: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    seed: int = 0,
    calls: int = 1,
    on_round: Callable[[], None] = lambda: None,
) -> dict[str, list[float]]:
    """Seconds per call of every step, measured in `rounds` rounds in which each
    step runs `calls` times (to `block_until_ready`), in a freshly shuffled order.
    Interleaving spreads the machine's noise evenly over the steps.

    **Returns:**

    `{name: [seconds per call] * rounds}`.
    """
    rounds = check_size("time_interleaved: rounds", rounds)
    calls = check_size("time_interleaved: calls", calls)
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        gc.collect()
        for name in order:
            out = None
            t0 = time.perf_counter()
            for _ in range(calls):
                out = steps[name]()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / calls)
        on_round()
    return times
