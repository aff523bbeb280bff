"""`Chain`: a sequence of layers that are not all alike, its grouping and its
answers to the layer-call seam."""

from .chain import Chain as Chain
from .groups import (
    chain_layer_fn as chain_layer_fn,
    check_chain_method as check_chain_method,
    lone_fn as lone_fn,
    Pattern as Pattern,
    Placement as Placement,
    run_groups as run_groups,
)
