"""optax helpers for models built from [`eqxscan.Stacked`][] layers: a weight-decay
mask, frozen layers, any transformation run per layer (`layerwise`), Muon with
the layer axes as batch axes, layer-wise learning rates and per-layer norms."""

from ._layers import (
    freeze_layers as freeze_layers,
    weight_decay_mask as weight_decay_mask,
)
from ._layerwise import (
    layerwise as layerwise,
    LayerwiseState as LayerwiseState,
)
from ._muon import (
    muon as muon,
    muon_dimension_numbers as muon_dimension_numbers,
)
from ._scale import layerwise_scale as layerwise_scale
from ._stats import layer_norms as layer_norms
