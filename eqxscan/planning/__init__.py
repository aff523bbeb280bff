"""Planning a training run for `N` devices ahead of time: every mesh (data x fsdp x
model) and remat setting compiled with abstract, sharded arguments (nothing is
allocated), XLA's per-device figures, and the fastest that fits.

Where this process has fewer than `N` devices, the candidates are compiled in a
child process with `N` simulated CPU devices (`--xla_force_host_platform_device_count`
must be set before JAX starts), which takes the model builder, step and optimiser
by reference (`"module:attribute"`); JAX has no CPU topology description
(`jax.experimental.topologies`) that would avoid the child.
"""

from ._report import (
    Accelerator as Accelerator,
    ACCELERATORS as ACCELERATORS,
    MeshCandidate as MeshCandidate,
    MeshPlan as MeshPlan,
)
from ._search import plan as plan
