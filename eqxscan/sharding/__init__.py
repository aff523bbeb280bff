"""Data-parallel, FSDP and pipeline sharding of models built from
[`eqxscan.Stacked`][] layers.

Built on JAX's own sharding (`Mesh`, `NamedSharding`, `jit`); see
`docs/sharding.md`. Beside it: `eqxscan.planning` (which mesh to use),
`eqxscan.distributed` (several processes) and
`eqxscan.checkpoint.CheckpointManager` (sharded training checkpoints, Orbax).
"""

from .._internal import constrain as constrain
from ._create import create as create
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
    MIN_SIZE as MIN_SIZE,
    model_shardings as model_shardings,
    opt_state_shardings as opt_state_shardings,
    shard as shard,
)
