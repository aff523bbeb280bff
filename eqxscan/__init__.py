"""eqxscan: scan over layers and over time, first-class for Equinox."""

from ._engine import AUTO_POLICY as AUTO_POLICY
from ._mlp import MLPBlock as MLPBlock, rms_norm as rms_norm, StackedMLP as StackedMLP
from ._recurrent import (
    Bidirectional as Bidirectional,
    ElmanCell as ElmanCell,
    Recurrent as Recurrent,
)
from ._stacked import per_layer as per_layer, PerLayer as PerLayer, Stacked as Stacked


__version__ = "0.1.0"
