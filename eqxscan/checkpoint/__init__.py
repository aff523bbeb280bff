"""Checkpoints of stacked models. The functions that save and load them are at
the top level: per-layer state dicts ([`eqxscan.to_state_dict`][],
`"blocks.3.w1"`), safetensors files (one or sharded as Hugging Face lays them
out; [`eqxscan.save`][] and [`eqxscan.load`][]) and Flax `nn.scan` import
([`eqxscan.from_flax_scan`][]). Here: name maps to other conventions
([`eqxscan.checkpoint.NameMap`][]), lazily read files
([`eqxscan.checkpoint.open_safetensors`][]), and sharded multi-process
checkpoints ([`eqxscan.checkpoint.CheckpointManager`][], Orbax; imported on
first use, with `eqxscan.sharding`)."""

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from ._files import CorruptFileError as CorruptFileError
from ._flax import flax_scan_state as flax_scan_state
from ._names import (
    Join as Join,
    NameMap as NameMap,
    Reshape as Reshape,
    Rule as Rule,
    Split as Split,
    Transpose as Transpose,
)
from ._safetensors import open_safetensors as open_safetensors, Opened as Opened


if _TYPE_CHECKING:
    from ._orbax import CheckpointManager as CheckpointManager


def __getattr__(name: str) -> object:
    # PEP 562: the Orbax manager (and sharding with it) imported on first use.
    if name == "CheckpointManager":
        return _importlib.import_module("._orbax", __name__).CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "CheckpointManager"})
