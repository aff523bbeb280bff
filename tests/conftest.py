import os


# Tests run on CPU with two host devices, as Equinox's own suite does.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    """A fresh PRNG key on every call, deterministic per test."""
    keys = iter(jr.split(jr.key(5678), 1000))
    return lambda: next(keys)
