"""Planning a training run for `N` devices ahead of time: every mesh (data x fsdp x
model) and remat setting compiled, XLA's per-device figures, and the fastest that
fits.

Nothing is allocated: the model is built with `eqx.filter_eval_shape` and each
candidate is `jax.jit(...).lower(...).compile()`d with abstract, sharded
arguments. A compile needs `N` devices of some kind; where the current process
has fewer, the candidates are compiled in a child process with `N` simulated CPU
devices (`--xla_force_host_platform_device_count`, which must be set before JAX
starts), so the model builder, the step and the optimiser are then passed by
reference (`"module:attribute"`). The installed JAX has no CPU topology
description (`jax.experimental.topologies`), which would avoid the child.

- `_search.py`: `plan` itself: its arguments checked, the compiles, the choice.
- `_candidates.py`: the meshes, the `Job` every candidate compiles, one
  candidate's program and figures.
- `_hlo.py`: collective bytes and matmul FLOPs read from the compiled HLO.
- `_spec.py`, `_child.py` (`__main__.py`): the work as JSON, and the fresh process
  that compiles it.
- `_report.py`: `MeshCandidate`, `MeshPlan` and its table, the accelerators.
"""

from ._report import (
    Accelerator as Accelerator,
    ACCELERATORS as ACCELERATORS,
    MeshCandidate as MeshCandidate,
    MeshPlan as MeshPlan,
)
from ._search import plan as plan
