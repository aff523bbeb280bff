"""The core's internal API: the one list of private names of the core (the
folders `_helpers`, `_scan`, `_containers`, `_features`) that the subpackages may
use; `tests/test_layout.py` fails on any other import of a core private module.
A name here is kept stable for the subpackages, not for users."""

from ._containers.stack_calls import scan_layers as scan_layers
from ._containers.stacked import (
    LayerNumbering as LayerNumbering,
    permute_stack as permute_stack,
    restack as restack,
)
from ._containers.stage_order import (
    layers_in_stage_order as layers_in_stage_order,
    permute_stage_order as permute_stage_order,
)
from ._containers.walk import (
    check_axes as check_axes,
    for_each as for_each,
    key_name as key_name,
    layer_names as layer_names,
    pattern as pattern,
    resolve as resolve,
    Site as Site,
    walk as walk,
)
from ._containers.weight_targets import (
    MatmulOnly as MatmulOnly,
    replace_weights as replace_weights,
    stands_for_weight as stands_for_weight,
    StandsForWeight as StandsForWeight,
    stored_sharding as stored_sharding,
)
from ._helpers.checks import (
    check_callable as check_callable,
    check_index as check_index,
    check_like as check_like,
    check_mesh as check_mesh,
    check_size as check_size,
    Checked as Checked,
    describe as describe,
    docs as docs,
    first_difference as first_difference,
    is_arraylike as is_arraylike,
    listed as listed,
    noted as noted,
    split_key as split_key,
)
from ._helpers.constrain import (
    align as align,
    constrain as constrain,
    is_none as is_none,
    is_placeholder as is_placeholder,
)
from ._helpers.host import (
    host_only as host_only,
    is_key as is_key,
    key_data as key_data,
    keys_like as keys_like,
    Lazy as Lazy,
    narrowed as narrowed,
    placed_like as placed_like,
    scalars_kept as scalars_kept,
    weak_like as weak_like,
)
from ._helpers.jax_private import (
    Device as Device,
    distributed_client as distributed_client,
)
from ._scan.auto import (
    AutoChoice as AutoChoice,
    StepCost as StepCost,
    THRESHOLDS as THRESHOLDS,
    Thresholds as Thresholds,
)
from ._scan.call_state import (
    call_state as call_state,
    changed_call_state as changed_call_state,
)
from ._scan.drop_rates import (
    carry_examples as carry_examples,
    check_droppable as check_droppable,
    check_rate as check_rate,
    DropInputs as DropInputs,
    keep_bits as keep_bits,
)
from ._scan.layer_call import (
    index as index,
    LayerCall as LayerCall,
    write as write,
)
from ._scan.options import (
    Remat as Remat,
    Scanning as Scanning,
)
from ._scan.scan_remat import matmul_policy as matmul_policy
from ._scan.setting_names import (
    parse_bytes as parse_bytes,
    remat_label as remat_label,
    size_label as size_label,
)
from ._scan.tap_stats import (
    max_abs as max_abs,
    nonfinite_count as nonfinite_count,
    rms as rms,
)
from ._scan.taps import tapping as tapping
