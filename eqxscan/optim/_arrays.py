"""Type guards for arrays and stacks, and the layer numbers of a stacked array."""

from typing import TypeGuard

import equinox as eqx
import jax
import numpy as np

from .. import Stacked
from .._internal import LayerNumbering, Site


def is_stacked(x: object) -> bool:
    return isinstance(x, Stacked)


def is_array(x: object) -> TypeGuard[jax.Array | np.ndarray]:
    """`eqx.is_array(x)` (a NumPy scalar too, which acts as a 0-d array)."""
    return eqx.is_array(x)


def layer_numbers(site: Site) -> list[np.ndarray]:
    """For each layer index in `site`'s name, the layer number at each element
    of the layer axes (shaped like them): `start + sum(i[k] * strides[k])`, each
    `LayerNumbering` over its own axes."""
    grid = iter(np.indices(site.axes, dtype=int))
    return [
        np.broadcast_to(p.number([next(grid) for _ in p.strides]), site.axes)
        for p in site.path
        if isinstance(p, LayerNumbering)
    ]
