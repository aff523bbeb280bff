"""Checkpoints of stacked models: per-layer state dicts (`"blocks.3.w1"`),
safetensors files (one or sharded as Hugging Face lays them out; `save` and
`load`), name maps to other conventions, Flax `nn.scan` import, and sharded
multi-process checkpoints ([`eqxscan.checkpoint.CheckpointManager`][], Orbax;
imported on first use, with `eqxscan.sharding`). The save and load functions
are also at the top level (`eqxscan.save`, `eqxscan.to_state_dict`, ...)."""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from ._files import CorruptFileError as CorruptFileError
from ._flax import flax_scan_state as flax_scan_state, from_flax_scan as from_flax_scan
from ._names import (
    Join as Join,
    NameMap as NameMap,
    Reshape as Reshape,
    Rule as Rule,
    Split as Split,
    Transpose as Transpose,
)
from ._safetensors import (
    load_safetensors as load_safetensors,
    open_safetensors as open_safetensors,
    Opened as Opened,
    read_safetensors as read_safetensors,
    save_safetensors as save_safetensors,
)
from ._serialise import (
    load as load,
    load_state_dict as load_state_dict,
    save as save,
)
from ._state_dict import (
    from_state_dict as from_state_dict,
    to_state_dict as to_state_dict,
)


if _TYPE_CHECKING:
    from ._orbax import CheckpointManager as CheckpointManager


def __getattr__(name: str) -> object:
    # PEP 562: the Orbax manager (and sharding with it) imported on first use.
    if name == "CheckpointManager":
        return _importlib.import_module("._orbax", __name__).CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "CheckpointManager"})
