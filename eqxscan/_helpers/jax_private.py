"""Every use of JAX's private modules (`jax._src`), in one place: each name is
looked up on use, and a JAX without it degrades as each function says rather
than failing at import (`tests/test_jax_private.py` checks `missing()`)."""

import importlib
from typing import Any, TYPE_CHECKING

import jax


if TYPE_CHECKING:
    # `jax.Device`'s class: jax exports it as a variable, no type to the checker.
    from jaxlib._jax import Device
else:  # the same class, named at run time for the runtime type checker
    Device = jax.Device


#: `(module, attribute path)` of every private name used.
NAMES = (
    ("jax._src.traceback_util", "register_exclusion"),
    ("jax._src.distributed", "global_state.client"),
)


def _lookup(module: str, attribute: str) -> Any:
    try:
        found: Any = importlib.import_module(module)
    except ImportError:
        return None
    for part in attribute.split("."):
        found = getattr(found, part, None)
    return found


def missing() -> list[str]:
    """The names of `NAMES` this JAX lacks (of `client`, `None` until a job is
    joined, only its holder)."""
    return [
        f"{module}.{attribute}"
        for module, attribute in NAMES
        if _lookup(module, attribute.rpartition(".")[0] or attribute) is None
    ]


def register_exclusion(path: str) -> None:
    """Hide the frames of files under `path` from JAX's filtered tracebacks (a
    JAX without `register_exclusion` shows them)."""
    register = _lookup("jax._src.traceback_util", "register_exclusion")
    if register is not None:
        register(path)


def distributed_client() -> Any | None:
    """The client of JAX's key-value store for the multi-process job joined, or
    `None` (also where this JAX lacks the name)."""
    return _lookup("jax._src.distributed", "global_state.client")


def key_impl(dtype: object) -> Any | None:
    """The PRNG implementation of a typed key dtype (`key<fry>`), where only the
    dtype is at hand (a `jax.ShapeDtypeStruct`, which `jax.random.key_impl`
    refuses); `None` where this JAX keeps it elsewhere."""
    return getattr(dtype, "_impl", None)
