"""eqxscan: scan over layers and over time, first-class for Equinox.

`import eqxscan` imports the containers and the scan engine only (the package's
layout: docs/concepts.md); every other name here (the subpackages, and the
functions and models they lend the top level, `eqxscan.save`,
`eqxscan.StackedMLP`, ...) is imported on first use (PEP 562), so that a script
that only scans does not import the rest, nor the libraries of the optional parts
(optax, Orbax).
"""

import importlib as _importlib
import importlib.metadata as _metadata
import pkgutil as _pkgutil
from typing import TYPE_CHECKING as _TYPE_CHECKING

from ._containers.chain import Chain as Chain
from ._containers.recurrent import (
    Bidirectional as Bidirectional,
    Recurrent as Recurrent,
)
from ._containers.stacked import Stacked as Stacked
from ._scan.auto import explain_auto as explain_auto
from ._scan.buffers import (
    Buffer as Buffer,
    buffer as buffer,
    LayerBuffers as LayerBuffers,
    per_layer as per_layer,
)
from ._scan.call_state import layer_index as layer_index
from ._scan.drop_rates import (
    DropRates as DropRates,
    linear_rates as linear_rates,
    LinearRates as LinearRates,
    Rates as Rates,
)
from ._scan.options import Mode as Mode, Remat as Remat, ScanOptions as ScanOptions
from ._scan.probe import Probe as Probe, probe as probe
from ._scan.scan_remat import ScanRemat as ScanRemat
from ._scan.tap_call import tap as tap


# isort: split
# Linear recurrences: cells `Recurrent` can run in parallel over time.
from ._containers.linear_cells import (
    DiagonalLinearCell as DiagonalLinearCell,
    MatrixLinearCell as MatrixLinearCell,
)
from ._containers.linear_diag import diagonal_scan as diagonal_scan


__version__ = _metadata.version("eqxscan")


# Imported on first use; type checkers and the API reference read them here.
if _TYPE_CHECKING:
    from . import (
        adapters as adapters,
        checkpoint as checkpoint,
        distributed as distributed,
        optim as optim,
        planning as planning,
        quant as quant,
        remat as remat,
        sharding as sharding,
        stats as stats,
    )
    from ._containers.linear_matrix import matrix_scan as matrix_scan
    from ._containers.weight_targets import Orientation as Orientation, Target as Target
    from ._features.buffer_layout import layer_buffers as layer_buffers
    from ._features.early_exit import run_until as run_until
    from ._features.layer_subsets import run_layers as run_layers
    from ._features.nonfinite import (
        find_nonfinite as find_nonfinite,
        NonFinite as NonFinite,
    )
    from ._models.cells import (
        ElmanCell as ElmanCell,
        GatedLinearAttention as GatedLinearAttention,
        LRU as LRU,
        MinGRU as MinGRU,
    )
    from ._models.mlp import MLPBlock as MLPBlock, StackedMLP as StackedMLP
    from .checkpoint._flax import from_flax_scan as from_flax_scan
    from .checkpoint._safetensors import (
        load_safetensors as load_safetensors,
        read_safetensors as read_safetensors,
        save_safetensors as save_safetensors,
    )
    from .checkpoint._serialise import (
        load as load,
        load_state_dict as load_state_dict,
        save as save,
    )
    from .checkpoint._state_dict import (
        from_state_dict as from_state_dict,
        to_state_dict as to_state_dict,
    )

# The subpackages: every module of the package not named `_...`.
_SUBPACKAGES = [m.name for m in _pkgutil.iter_modules(__path__) if m.name[0] != "_"]
# Each top-level name lent by a module outside the core, by that module.
_LENT = {
    "layer_buffers": "._features.buffer_layout",
    "run_until": "._features.early_exit",
    "run_layers": "._features.layer_subsets",
    "find_nonfinite": "._features.nonfinite",
    "NonFinite": "._features.nonfinite",
    "from_flax_scan": ".checkpoint._flax",
    **dict.fromkeys(
        ("load_safetensors", "read_safetensors", "save_safetensors"),
        ".checkpoint._safetensors",
    ),
    **dict.fromkeys(("load", "load_state_dict", "save"), ".checkpoint._serialise"),
    **dict.fromkeys(("from_state_dict", "to_state_dict"), ".checkpoint._state_dict"),
    "matrix_scan": "._containers.linear_matrix",
    "Orientation": "._containers.weight_targets",
    "Target": "._containers.weight_targets",
    "ElmanCell": "._models.cells",
    "GatedLinearAttention": "._models.cells",
    "LRU": "._models.cells",
    "MinGRU": "._models.cells",
    "MLPBlock": "._models.mlp",
    "StackedMLP": "._models.mlp",
}


def __getattr__(name: str) -> object:
    # PEP 562: a subpackage, or a name lent by one, imported on first use.
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _LENT:
        value = getattr(_importlib.import_module(_LENT[name], __name__), name)
        globals()[name] = value  # once: later uses do not come here
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBPACKAGES, *_LENT})
