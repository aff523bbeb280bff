"""optax helpers for models built from [`eqxscan.Stacked`][] layers: a weight-decay
mask, frozen layers, any transformation run per layer (`layerwise`), Muon with
the layer axes as batch axes, layer-wise learning rates and per-layer norms.
Needs optax: `pip install "eqxscan[optim]"`."""

try:
    import optax as _optax  # noqa: F401
except ImportError as _e:
    if (_e.name or "").split(".")[0] != "optax":
        raise  # optax is there, but fails to import
    raise ModuleNotFoundError(
        "eqxscan.optim needs optax, which is not installed.\n"
        'Hint: pip install "eqxscan[optim]" (or optax).',
        name="optax",
    ) from _e

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
