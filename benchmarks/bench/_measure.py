"""What the benchmark measures: agreement, compilation and steady-state steps.

All of these open the device, so `python -m benchmarks.bench` calls them only in
its worker subprocesses (see `_worker.py`), one at a time: a TPU, or a GPU with
memory preallocation, is held by one process at a time. `measure_compile` and
`measure_steps` also need fresh processes so that nothing compiled earlier is
reused.
"""

import functools
import importlib
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from eqxscan import explain_auto, StackedMLP
from eqxscan.remat import matmul_policy, time_interleaved

from ._impls import Built, Impl, IMPLS, LOOP, MismatchError, rel_err, TOLERANCES
from ._transformer import IMPLS as TRANSFORMER_IMPLS, transformer_problem
from ._values import Normals


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
WARMUP = 1
#: `problem(num_layers, dim, batch, seq, dtype) -> (model, x, y)`.
ProblemMaker = Callable[[int, int, int, int, str], tuple[eqx.Module, Array, Array]]


def model_flops(num_layers: int, dim: int, tokens: int) -> int:
    """Model FLOPs of one train step, counted analytically: two matmuls per layer
    (`[N, D] @ [D, 4D]` and `[N, 4D] @ [4D, D]`, 2*N*D*4D FLOPs each) forward, and
    three times the forward for forward + backward. Elementwise work and any
    recomputation by rematerialisation are not counted."""
    return 3 * num_layers * 2 * (2 * tokens * dim * 4 * dim)


def mlp_problem(
    num_layers: int, dim: int, batch: int, seq: int, dtype: str, seed: int = 0
) -> tuple[StackedMLP, Array, Array]:
    """The model and one batch `(x, y)`, identical for every implementation."""
    dt = DTYPES[dtype]
    # The layout comes from `StackedMLP` itself (traced, not run); the values are
    # drawn on the device (see `Normals`).
    shapes = eqx.filter_eval_shape(
        StackedMLP, dim, num_layers, key=jax.random.key(0), dtype=dt
    )
    normals = Normals(seed)

    def init(leaf: object) -> object:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        # Fan-in scaling for the weights, ones for the norm scales.
        if len(leaf.shape) == 3:
            return normals(leaf.shape, dt, scale=1 / np.sqrt(leaf.shape[1]))
        return jnp.ones(leaf.shape, dt)

    model = jax.tree.map(init, shapes)
    x = normals((batch, seq, dim), dt)
    y = normals((batch, seq, dim), dt)
    return model, x, y


#: Names a module that adds implementations, to benchmark one of your own without
#: editing this package: its `MLP_IMPLS` and `TRANSFORMER_IMPLS` dicts (name ->
#: `Impl`) join each model's. An environment variable, so that the workers see it.
EXTRA_IMPLS_ENV = "BENCH_EXTRA_IMPLS"


def registry(model: str) -> tuple[Mapping[str, Impl[Any]], ProblemMaker]:
    """The implementations and the problem maker of a benchmark model (`"mlp"` or
    `"transformer"`); each model's implementations take that model's type, and
    include those of the module named by `$BENCH_EXTRA_IMPLS`."""
    impls, make = (
        (TRANSFORMER_IMPLS, transformer_problem)
        if model == "transformer"
        else (IMPLS, mlp_problem)
    )
    extra = os.environ.get(EXTRA_IMPLS_ENV)
    if extra:
        module = importlib.import_module(extra)
        name = "TRANSFORMER_IMPLS" if model == "transformer" else "MLP_IMPLS"
        impls = {**impls, **getattr(module, name, {})}
    return impls, make


def make_problem(
    model: str, num_layers: int, dim: int, batch: int, seq: int, dtype: str
) -> tuple[eqx.Module, Array, Array]:
    """The benchmark's model and one batch `(x, y)` of shape `[batch, seq, dim]`.

    **Arguments:**

    - `model`: `"mlp"` (a `StackedMLP`) or `"transformer"` (a `Stacked` of
      `Block`s).
    - `num_layers`, `dim`, `batch`, `seq`: the sizes.
    - `dtype`: `"float32"` or `"bfloat16"`.

    **Returns:**

    `(module, x, y)`: the same weights (from NumPy, seeded) and data as every
    implementation of `python -m benchmarks.bench` starts from.
    """
    return registry(model)[1](num_layers, dim, batch, seq, dtype)


#: The precision of every matmul in the agreement check: at the default, a TPU
#: rounds float32 matmul inputs to bfloat16, and programs that compute the same
#: thing in a different order disagree by more than float32's tolerance.
CHECK_PRECISION = "highest"


def check_agreement(
    impls: Sequence[Impl[Any]],
    *,
    num_layers: int,
    dim: int,
    batch: int,
    seq: int,
    model: str = "mlp",
    dtype: str = "float32",
    tolerance: float | None = None,
) -> dict[str, float]:
    """Check that every implementation gives the loop's loss and gradients.

    All run in `dtype` from the same weights, with every matmul at
    `CHECK_PRECISION`. The reference is the unrolled loop (`eqxscan-loop`),
    whether or not it is among `impls`; gradients are compared in the model's
    `Canon` layout. Implementations without one (the matmul floor) are skipped.

    **Arguments:**

    - `impls`: the implementations to check.
    - `num_layers`, `dim`, `batch`, `seq`: the size to check at.
    - `model`: `"mlp"` or `"transformer"`.
    - `dtype`: `"float32"` or `"bfloat16"`.
    - `tolerance`: the largest relative error allowed; default `TOLERANCES[dtype]`.

    **Returns:**

    `{name: max relative error over the loss and every gradient}`.

    **Raises:**

    `MismatchError` naming the implementation, the quantity and both values when
    an error exceeds the tolerance.
    """
    limit = TOLERANCES[dtype] if tolerance is None else tolerance
    registered, make = registry(model)
    size = f"L={num_layers}, D={dim}, batch {batch}, seq {seq}, {dtype}"
    size = size if model == "mlp" else f"{model.capitalize()}, {size}"
    with jax.default_matmul_precision(CHECK_PRECISION):
        module, x, y = make(num_layers, dim, batch, seq, dtype)

        def run(impl: Impl[Any]) -> tuple[Array, dict[str, Array]] | None:
            built = impl.build(module)
            if built.to_canon is None:
                return None
            loss, grads = jax.jit(jax.value_and_grad(built.loss))(built.params, x, y)
            return loss, {"loss": loss, **built.to_canon(grads)}

        reference = run(registered[LOOP])
        assert reference is not None
        errors = {}
        for impl in impls:
            try:
                found = run(impl)
            except Exception as e:
                raise MismatchError(
                    f"{impl.name} ({impl.description}) failed to compute the train "
                    f"step: {type(e).__name__}: {e}"
                ) from e
            if found is not None:
                errors[impl.name] = _worst_error(impl, found, reference, limit, size)
    return errors


def _worst_error(
    impl: Impl[Any],
    found: tuple[Array, dict[str, Array]],
    reference: tuple[Array, dict[str, Array]],
    tolerance: float,
    size: str,
) -> float:
    (loss, got), (ref_loss, ref) = found, reference
    worst = 0.0
    for what, value in got.items():
        label = what if what == "loss" else f"gradient of {what}"
        if np.shape(value) != np.shape(ref[what]):
            raise MismatchError(
                f"{impl.name} ({impl.description}) gives a {label} of shape "
                f"{np.shape(value)}, but the unrolled loop gives "
                f"{np.shape(ref[what])}."
            )
        err = rel_err(value, ref[what])
        if not err <= tolerance:
            raise MismatchError(
                f"{impl.name} ({impl.description}) disagrees with the unrolled "
                f"loop ({LOOP}) on the {label}: max relative error {err:.3g} > "
                f"{tolerance:g} ({size}, matmul precision {CHECK_PRECISION}; loss "
                f"{float(loss):.6g} vs {float(ref_loss):.6g}). Benchmarking "
                "implementations that compute different things would be "
                "meaningless, so the run stops here."
            )
        worst = max(worst, err)
    return worst


class _Compiled(NamedTuple):
    built: Built
    lowered: jax.stages.Lowered
    compiled: jax.stages.Compiled
    #: Trace, lower, XLA compile and their total.
    seconds: tuple[float, float, float, float]


def _compile_once(impl: Impl[Any], module: eqx.Module, x: Array, y: Array) -> _Compiled:
    """One fresh compile (JAX's caches cleared first) of `impl`'s train step."""
    jax.clear_caches()
    built = impl.build(module)
    jax.block_until_ready(built.params)
    step = jax.jit(jax.value_and_grad(built.loss))
    t0 = time.perf_counter()
    traced = step.trace(built.params, x, y)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    return _Compiled(built, lowered, compiled, (t1 - t0, t2 - t1, t3 - t2, t3 - t0))


def measure_compile(
    name: str,
    *,
    num_layers: int,
    dim: int,
    batch: int,
    seq: int,
    dtype: str,
    model: str = "mlp",
    compile_repeats: int = 1,
) -> dict[str, Any]:
    """Trace, lower and compile one implementation's train step (AOT), separately
    timed, and read the lowered program size and XLA's memory analysis. With
    `compile_repeats > 1` the step is compiled afresh that many times (JAX's
    caches cleared in between) and the times are medians."""
    impls, make = registry(model)
    module, x, y = make(num_layers, dim, batch, seq, dtype)
    row, _ = _compile_row(
        name, impls[name], (module, x, y), num_layers, compile_repeats
    )
    return row


def _compile_row(
    name: str,
    impl: Impl[Any],
    problem: tuple[eqx.Module, Array, Array],
    num_layers: int,
    repeats: int,
) -> tuple[dict[str, Any], _Compiled]:
    """`measure_compile`'s row, and the last compile (to run its steps)."""
    module, x, y = problem
    runs = [_compile_once(impl, module, x, y) for _ in range(repeats)]
    samples = [run.seconds for run in runs]
    trace_s, lower_s, compile_s, total_s = (
        statistics.median(column) for column in zip(*samples)
    )
    built, lowered, compiled = runs[-1].built, runs[-1].lowered, runs[-1].compiled
    mem = compiled.memory_analysis()
    row = {
        "impl": name,
        "layers": num_layers,
        # What the default resolved to (the other eqxscan entries set `remat`).
        "auto": (
            resolved_auto(built.loss, built.params, x, y) if name == "eqxscan" else None
        ),
        "trace_s": trace_s,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "total_s": total_s,
        "total_samples": [s[3] for s in samples],
        "hlo_lines": len(lowered.as_text().splitlines()),
        "temp_bytes": None if mem is None else int(mem.temp_size_in_bytes),
        "argument_bytes": None if mem is None else int(mem.argument_size_in_bytes),
        "output_bytes": None if mem is None else int(mem.output_size_in_bytes),
        "peak_rss_bytes": _peak_rss(),
    }
    return row, runs[-1]


def setting_label(remat: Any, unroll: int | bool) -> str:
    """A short name for a `(remat, unroll)` setting, as in `"matmul/u1"`:
    `save-all` (`False`), `remat` (`True`), `matmul`
    (`eqxscan.remat.matmul_policy`, the default's policy), else the option's
    repr; `full` when unrolled fully."""
    if remat is False or remat is True:
        name = "remat" if remat else "save-all"
    elif remat is matmul_policy:
        name = "matmul"
    else:
        name = getattr(remat, "__name__", repr(remat))
    return f"{name}/{'full' if unroll is True else f'u{unroll}'}"


def resolved_auto(fn: Callable, *args: Any) -> str | None:
    """What `"auto"` resolved to in `fn(*args)` (`setting_label` per scan, joined
    by `", "`); None when no scan used `"auto"`."""
    found = [setting_label(c.remat, c.unroll) for c in explain_auto(fn, *args)]
    return ", ".join(found) or None


def _peak_rss() -> int | None:
    """This process's peak resident memory in bytes (Linux; None elsewhere)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB


def out_of_memory(error: BaseException) -> str | None:
    """The first line of `error`'s message when it says that the device (or the
    host) ran out of memory, e.g. XLA's `RESOURCE_EXHAUSTED`, else `None`."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or any(m in text for m in OUT_OF_MEMORY):
        return next((ln for ln in text.splitlines() if ln.strip()), text)[:300]
    return None


#: What the errors of a program or an allocation too big for the device say.
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def measure_steps(
    names: Sequence[str],
    *,
    num_layers: int,
    dim: int,
    batch: int,
    seq: int,
    dtype: str,
    repeats: int,
    seed: int = 0,
    model: str = "mlp",
    on_round: Callable[[], None] = lambda: None,
) -> dict[str, dict[str, Any]]:
    """Steady-state train-step times of several implementations in one process.

    Each is compiled and warmed up first; then, `repeats` times, every
    implementation runs once, in a freshly shuffled order, and is timed to
    `block_until_ready`. Interleaving spreads the machine's noise evenly, so the
    ratios between implementations are meaningful even when the seconds are not.
    An implementation whose compile or first step runs out of memory is left out
    and named; the others are still timed.

    **Returns:**

    `{"times": {name: [seconds per step] * repeats}, "does_not_fit": {name:
    the error's first line}}`.
    """
    impls, make = registry(model)
    module, x, y = make(num_layers, dim, batch, seq, dtype)
    steps, too_big = {}, {}
    for name in names:
        try:
            built = impls[name].build(module)
            fn = jax.jit(jax.value_and_grad(built.loss)).lower(built.params, x, y)
            compiled = fn.compile()
            for _ in range(WARMUP):
                jax.block_until_ready(compiled(built.params, x, y))
        except Exception as e:
            if (message := out_of_memory(e)) is None:
                raise
            too_big[name] = message
            continue
        steps[name] = (compiled, built.params)
    times = time_interleaved(
        {
            name: functools.partial(fn, params, x, y)
            for name, (fn, params) in steps.items()
        },
        repeats,
        seed=seed,
        on_round=on_round,
    )
    return {"times": times, "does_not_fit": too_big}


def measure_depth(
    names: Sequence[str],
    *,
    num_layers: int,
    dim: int,
    batch: int,
    seq: int,
    dtype: str,
    repeats: int,
    compile_repeats: int = 1,
    loop_compile_repeats: int | None = None,
    seed: int = 0,
    model: str = "mlp",
    on_progress: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """`measure_compile` of each of `names`, and its steps timed on the program
    whose compile was measured, one implementation after another in this one
    process: on an accelerator a process takes seconds to open the device and a
    deep step seconds to compile, which separate processes would pay twice. Each
    implementation's program and parameters are released before the next, so
    that only one step's memory is on the device at a time (the device's own
    timing noise is small; `measure_steps` interleaves for a CPU's).

    **Returns:**

    `{"rows": [measure_compile's row, ...], "does_not_fit": {name: error}` (at
    compile), `"times": {name: [seconds per step] * repeats}, "steps_do_not_fit":
    {name: error}}` (at a step).
    """
    impls, make = registry(model)
    problem = make(num_layers, dim, batch, seq, dtype)
    _, x, y = problem
    # A process's first compile of these shapes pays setup the later ones reuse
    # (on a TPU v5e the default's XLA compile took 3.1 s first, 1.95 s for the
    # same program next): the first implementation is compiled once, discarded.
    try:
        _compile_once(impls[names[0]], *problem)
    except Exception as e:
        if out_of_memory(e) is None:
            raise
    rows, too_big, too_big_to_run, times = [], {}, {}, {}
    for name in names:
        runs = compile_repeats
        if name == LOOP and loop_compile_repeats is not None:
            runs = loop_compile_repeats
        try:
            row, done = _compile_row(name, impls[name], problem, num_layers, runs)
        except Exception as e:
            if (message := out_of_memory(e)) is None:
                raise
            too_big[name] = message
            on_progress()
            continue
        rows.append({**row, "peak_rss_bytes": None})
        step = functools.partial(done.compiled, done.built.params, x, y)
        del done
        try:
            for _ in range(WARMUP):
                jax.block_until_ready(step())
            times[name] = time_interleaved({name: step}, repeats, seed=seed)[name]
        except Exception as e:
            if (message := out_of_memory(e)) is None:
                raise
            too_big_to_run[name] = message
        del step
        on_progress()
    return {
        "rows": rows,
        "does_not_fit": too_big,
        "times": times,
        "steps_do_not_fit": too_big_to_run,
    }
