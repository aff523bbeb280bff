"""Data-parallel, FSDP and pipeline sharding of models built from
[`eqxscan.Stacked`][] layers.

Built on JAX's own sharding (`Mesh`, `NamedSharding`, `jit`), its multi-process
runtime and Orbax; see `docs/sharding.md` and `docs/multihost.md`.
"""

from .._internal import constrain as constrain
from ._create import create as create
from ._distributed import (
    check_same_job as check_same_job,
    initialize as initialize,
    local_rows as local_rows,
)
from ._mesh_plan import (
    Accelerator as Accelerator,
    ACCELERATORS as ACCELERATORS,
    MeshCandidate as MeshCandidate,
    MeshPlan as MeshPlan,
    plan as plan,
)
from ._orbax import CheckpointManager as CheckpointManager
from ._partition import (
    logical_shardings as logical_shardings,
    logical_spec as logical_spec,
)
from ._pipeline import (
    LayerOrder as LayerOrder,
    pipeline as pipeline,
    pipeline_order as pipeline_order,
    pipeline_schedule as pipeline_schedule,
    PipelineSchedule as PipelineSchedule,
    Schedule as Schedule,
)
from ._shard import (
    batch_shardings as batch_shardings,
    gather_layers as gather_layers,
    make_mesh as make_mesh,
    model_shardings as model_shardings,
    opt_state_shardings as opt_state_shardings,
    shard as shard,
)
