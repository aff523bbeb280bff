"""JAX's private names, used in one place (`eqxscan._helpers.jax_private`): the
installed JAX has them all, and a JAX without one degrades as documented."""

import sys

import jax
import pytest

from eqxscan._helpers import jax_private as _jax_private


def test_installed_jax_has_every_private_name():
    assert _jax_private.missing() == []
    import jax._src.distributed as jax_distributed
    import jax._src.traceback_util as traceback_util

    assert hasattr(jax_distributed.global_state, "client")
    # One process, no job joined: no client yet.
    assert _jax_private.distributed_client() is None
    # eqxscan's folder is excluded from JAX's filtered tracebacks.
    assert any("eqxscan" in p for p in traceback_util._exclude_paths)
    # An abstract key's implementation, from its dtype alone.
    keys = jax.random.split(jax.random.key(0, impl="rbg"), 2)
    dtype = jax.eval_shape(lambda: keys).dtype
    assert _jax_private.key_impl(dtype).name == "rbg"


def test_a_jax_without_them_degrades(monkeypatch):
    # `sys.modules[name] = None` makes `import name` raise ImportError.
    monkeypatch.setitem(sys.modules, "jax._src.traceback_util", None)
    monkeypatch.setitem(sys.modules, "jax._src.distributed", None)
    assert _jax_private.missing() == [
        "jax._src.traceback_util.register_exclusion",
        "jax._src.distributed.global_state.client",
    ]
    _jax_private.register_exclusion("/nowhere")  # does nothing
    assert _jax_private.distributed_client() is None
    # Abstract keys of a dtype without its implementation: a clear refusal.
    from eqxscan._helpers.host import keys_like

    with pytest.raises(TypeError, match="PRNG implementation of abstract keys"):
        keys_like(jax.ShapeDtypeStruct((), jax.numpy.float32), [0, 0])


def test_initialize_without_the_client_warns(monkeypatch):
    from eqxscan.distributed import _runtime

    # As on a job of two processes, joined, with a JAX lacking the client.
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: None)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(_runtime, "_agree", lambda *a, **k: None)
    monkeypatch.setattr(_runtime, "distributed_client", lambda: None)
    with pytest.warns(RuntimeWarning, match="no key-value store client"):
        _runtime.initialize("127.0.0.1:1", 2, 0, timeout=5.0)
