"""eqxscan: scan over layers and over time, first-class for Equinox.

The core is the private folders `_helpers`, `_scan` (options, remat, the one
scan engine, the layer-call seam), `_containers` (`Stacked`, `Chain`,
`Recurrent`) and `_features` (early exit, subsets, the non-finite finder). The
subpackages build on it: `remat`, `nn`, `checkpoint`, `sharding`, and, imported
on first use, `planning`, `distributed` and `optim` (so that `import eqxscan`
does not import optax).
"""

import importlib as _importlib
import importlib.metadata as _metadata
from typing import TYPE_CHECKING as _TYPE_CHECKING

from . import (
    adapters as adapters,
    checkpoint as checkpoint,
    nn as nn,
    quant as quant,
    remat as remat,
    sharding as sharding,
    stats as stats,
)
from ._containers.chain import Chain as Chain
from ._containers.recurrent import (
    Bidirectional as Bidirectional,
    Recurrent as Recurrent,
)
from ._containers.stacked import Stacked as Stacked
from ._features.buffer_layout import layer_buffers as layer_buffers
from ._features.early_exit import run_until as run_until
from ._features.layer_subsets import run_layers as run_layers
from ._features.nonfinite import (
    find_nonfinite as find_nonfinite,
    NonFinite as NonFinite,
)
from ._scan.buffers import (
    Buffer as Buffer,
    buffer as buffer,
    LayerBuffers as LayerBuffers,
    per_layer as per_layer,
)
from ._scan.drop_rates import (
    DropRates as DropRates,
    linear_rates as linear_rates,
    LinearRates as LinearRates,
    Rates as Rates,
)
from ._scan.layer_index import layer_index as layer_index
from ._scan.options import Mode as Mode, Remat as Remat, ScanOptions as ScanOptions
from ._scan.remat import ScanRemat as ScanRemat
from ._scan.taps import Probe as Probe, probe as probe, tap as tap
from .checkpoint import (
    from_flax_scan as from_flax_scan,
    from_state_dict as from_state_dict,
    load as load,
    load_safetensors as load_safetensors,
    load_state_dict as load_state_dict,
    read_safetensors as read_safetensors,
    save as save,
    save_safetensors as save_safetensors,
    to_state_dict as to_state_dict,
)
from .nn import ElmanCell as ElmanCell, MLPBlock as MLPBlock, StackedMLP as StackedMLP
from .remat import explain_auto as explain_auto


# isort: split
# Matrix-state linear recurrences (gated linear attention, SSD).
from ._containers.linear_matrix import matrix_scan as matrix_scan
from .nn import GatedLinearAttention as GatedLinearAttention


__version__ = _metadata.version("eqxscan")


if _TYPE_CHECKING:
    from . import distributed as distributed, optim as optim, planning as planning
_LAZY = ("distributed", "optim", "planning")


def __getattr__(name: str) -> object:
    # PEP 562: each of `_LAZY` is imported on first use.
    if name in _LAZY:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
