"""eqxscan: scan over layers and over time, first-class for Equinox."""

import importlib.metadata

from . import optim as optim, sharding as sharding
from ._auto import (
    AutoChoice as AutoChoice,
    explain_auto as explain_auto,
    StepCost as StepCost,
)
from ._budget import (
    fit_remat as fit_remat,
    parse_bytes as parse_bytes,
    remat_table as remat_table,
    RematCandidate as RematCandidate,
    RematTable as RematTable,
)
from ._chain import Chain as Chain
from ._devices import Peak as Peak
from ._flax import from_flax_scan as from_flax_scan
from ._mlp import MLPBlock as MLPBlock, StackedMLP as StackedMLP
from ._options import (
    Checkpoint as Checkpoint,
    Mode as Mode,
    ScanOptions as ScanOptions,
)
from ._recurrent import (
    Bidirectional as Bidirectional,
    ElmanCell as ElmanCell,
    Recurrent as Recurrent,
)
from ._remat import ScanCheckpoint as ScanCheckpoint
from ._serialise import load as load, load_state_dict as load_state_dict, save as save
from ._stacked import per_layer as per_layer, PerLayer as PerLayer, Stacked as Stacked
from ._state_dict import (
    from_state_dict as from_state_dict,
    to_state_dict as to_state_dict,
)


__version__ = importlib.metadata.version("eqxscan")
