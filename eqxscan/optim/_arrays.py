"""`eqx.is_array` as a type guard, for the walks over parameters and updates."""

from typing import TypeGuard

import equinox as eqx
import jax
import numpy as np


def is_array(x: object) -> TypeGuard[jax.Array | np.ndarray]:
    """`eqx.is_array(x)`: a JAX or NumPy array (a NumPy scalar too, which acts
    as a 0-d array)."""
    return eqx.is_array(x)
