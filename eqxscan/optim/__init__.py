"""Optimiser helpers for models built from [`eqxscan.Stacked`][] layers: a
layer-axis-aware weight-decay mask, freezing of chosen layers, and any optax
transformation run per layer (`per_layer`).
"""

from ._layers import (
    freeze_layers as freeze_layers,
    weight_decay_mask as weight_decay_mask,
)
from ._per_layer import (
    per_layer as per_layer,
    PerLayerState as PerLayerState,
)
