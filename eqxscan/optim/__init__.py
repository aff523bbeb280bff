"""Optimiser helpers for models built from [`eqxscan.Stacked`][] layers: a
layer-axis-aware weight-decay mask and freezing of chosen layers, for `optax`.
"""

from ._layers import (
    freeze_layers as freeze_layers,
    weight_decay_mask as weight_decay_mask,
)
