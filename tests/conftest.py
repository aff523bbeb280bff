import atexit
import gc
import os
import shutil
import tempfile


# Tests run on CPU with two host devices, as Equinox's own suite does.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA's backend (LLVM) optimisations cost most of a small program's compile
# time and change no program's structure: memory_analysis(), cost_analysis()
# and the HLO the tests read are the same. Off by default (the processes that
# tests start inherit it); EQXSCAN_TEST_OPTIMIZE=1 turns them on, and a test
# whose tolerance is tighter than unoptimised arithmetic's rounding is marked
# `optimized`. XLA:CPU's older fusion emitters compile in about half the time
# of its MLIR ones, with the same buffers and values; and a program's machine
# code generated as one LLVM module rather than split into 32 for parallel
# codegen costs about a quarter less compile CPU (on two cores the split bought
# no time), with the same buffers and values that can differ in the last bit
# (as unoptimised arithmetic's do): EQXSCAN_TEST_XLA_FLAGS carries these flags
# to the processes tests start with their own XLA_FLAGS.
if os.environ.get("EQXSCAN_TEST_OPTIMIZE", "0") != "1":
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    os.environ.setdefault(
        "EQXSCAN_TEST_XLA_FLAGS",
        "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1",
    )
_extra = os.environ.get("EQXSCAN_TEST_XLA_FLAGS", "")
if _extra and _extra not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + _extra

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import pytest  # noqa: E402

from . import _typecheck_memo  # noqa: E402


# The runtime type checks' functions written once per signature, not at every
# decoration of a nested function (tests/_typecheck_memo.py).
_typecheck_memo.install()


jax.config.update(
    "jax_disable_most_optimizations",
    os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS", "0") == "1",
)

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# One compilation cache for the run: tests (and the processes they start) that
# build the same slow program compile it once.
# A fresh directory each run; EQXSCAN_TEST_CACHE=1 turns it on, and
# EQXSCAN_TEST_CACHE=worker gives each pytest-xdist worker its own (jax 0.9's
# cache is not safe for two processes writing one directory).
# Off by default. Full runs with it on segfaulted a worker while serialising
# an executable for it, as later runs without it did in compiles: all were a
# worker past Linux's limit on memory mappings (see `_free_compiled_programs`).
_CACHE_MODE = os.environ.get("EQXSCAN_TEST_CACHE", "0")
if _CACHE_MODE in ("1", "worker"):
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _cache = tempfile.mkdtemp(prefix="eqxscan-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    _worker = os.environ.get("PYTEST_XDIST_WORKER")
    if _CACHE_MODE == "worker" and _worker:
        # The controller made the directory and removes it; the workers inherit it.
        _cache = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], _worker)
        os.makedirs(_cache, exist_ok=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    # Only compiles of 0.25 s or more are written.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.25")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    jax.config.update(
        "jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"]
    )
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.25)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture
def getkey():
    """A fresh PRNG key on every call, deterministic per test."""
    keys = iter(jr.split(jr.key(5678), 1000))
    return lambda: next(keys)


@pytest.fixture(autouse=True)
def _optimized(request, monkeypatch):
    """`@pytest.mark.optimized`: this test compiles with XLA's optimisations on."""
    if request.node.get_closest_marker("optimized") is None:
        yield
        return
    monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "0")
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


# XLA:CPU maps each compiled program's code into pages of its own, three
# mappings a piece (six with its code split into 32 modules), and JAX's caches
# keep every program a worker compiled: a worker passed Linux's limit of 65,530
# mappings (`vm.max_map_count`) after a few thousand programs, and its next
# compile segfaulted. A file's programs are freed when it ends once the worker
# holds more than _FREE_AT mappings (below that they stay, so that the next
# files compile again none of the small programs they share, e.g. each eager
# operation's); a file that leaves more than _MAX_MAPPINGS after they are
# freed fails, naming itself, rather than crashing a later one.
_FREE_AT = 15_000
_MAX_MAPPINGS = 40_000


def _mappings() -> int | None:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs(request):
    yield
    count = _mappings()
    if count is not None and count <= _FREE_AT:
        return
    jax.clear_caches()
    gc.collect()
    count = _mappings()
    if count is not None and count > _MAX_MAPPINGS:
        pytest.fail(
            f"{request.node.name} left {count} memory mappings after its compiled "
            f"programs were freed (limit {_MAX_MAPPINGS}; Linux fails at 65,530).\n"
            "Something holds compiled programs beyond its test: see tests/conftest.py."
        )
