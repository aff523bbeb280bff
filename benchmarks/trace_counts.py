"""How many times each layer's `__call__` runs (is traced) under one
`eqx.filter_jit`, and how long tracing the Transformer bench's train step takes.

    python benchmarks/trace_counts.py [--layers 4 16 64] [--transformer-layers 64]

Table: for `Stacked`, `Chain` (two scanned groups and a lone layer; the most
calls of any of its layer classes) and `Recurrent` (a counting cell; the
"layers" column is then the number of time steps), the Python calls of the
layer (cell) per trace of the enclosing jit, forward (`model(x)`) and gradient
(`eqx.filter_grad` of a sum). Tracing only: `eqx.filter_jit(f).lower(...)`.

Trace time: the Transformer bench's block (`benchmarks.bench.Block`: pre-norm
attention + MLP, D=256, B=8, T=64, fp32) stacked L times, with the
default options; timed is `jax.jit(step).trace(params, x, y)` for a fresh
`step = jax.value_and_grad(loss)` each time (nothing is lowered or compiled),
best of 3 (`--clock cpu`: by CPU time rather than wall time).
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from bench import Block, mse

import eqxscan


REMATS = (("default", None), ("False", False), ("True", True))
REMATS += (('"nested"', "nested"), ('"offload"', "offload"))
WIDTH = 4

_calls: dict[str, int] = {}


class Counted(eqx.Module):
    """A layer (`x -> x`) that counts the Python calls of its `__call__`."""

    linear: eqx.nn.Linear
    name: str = eqx.field(static=True)

    def __init__(self, name: str, *, key: jax.Array):
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=key)
        self.name = name

    def __call__(self, x: jax.Array) -> jax.Array:
        _calls[self.name] = _calls.get(self.name, 0) + 1
        return jnp.tanh(self.linear(x))


class CountedCell(eqx.Module):
    """A recurrent cell `cell(x, h) -> h` that counts its calls."""

    linear: eqx.nn.Linear

    def __init__(self, width: int = WIDTH, *, key: jax.Array):
        self.linear = eqx.nn.Linear(2 * width, width, key=key)

    def __call__(self, x: jax.Array, h: jax.Array) -> jax.Array:
        _calls["cell"] = _calls.get("cell", 0) + 1
        return jnp.tanh(self.linear(jnp.concatenate([x, h])))


class CountedB(Counted):
    """Another class, so that a `Chain` scans its run apart from `Counted`'s."""


def _lone(x: jax.Array) -> jax.Array:
    _calls["lone"] = _calls.get("lone", 0) + 1
    return x * 2.0


def make_case(kind: str, length: int, remat: object, mode: str = "scan"):
    """`(fn, model, input)` for one case; `remat=None` keeps the default."""
    options = {"mode": mode}
    if remat is not None:
        options["remat"] = remat
    key = jr.key(0)
    x = jnp.ones(WIDTH)
    if kind == "Stacked":
        stack = eqxscan.Stacked(
            lambda k: Counted("a", key=k), length, key=key, **options
        )
        return (lambda m, x: m(x)), stack, x
    if kind == "Chain":
        # Two scanned runs (two classes) and a lone layer.
        keys = jr.split(key, length)
        half = length // 2
        layers = [Counted("a", key=k) for k in keys[:half]]
        layers += [CountedB("b", key=k) for k in keys[half:]]
        layers += [eqx.nn.Lambda(_lone)]
        return (lambda m, x: m(x)), eqxscan.Chain(layers, **options), x
    rnn = eqxscan.Recurrent(CountedCell(key=key), **options)
    xs = jnp.ones((length, WIDTH))
    return (lambda m, xs: m(jnp.zeros(WIDTH), xs)[0]), rnn, xs


def count_calls(
    kind: str, length: int, remat: object, grad: bool, mode: str = "scan"
) -> dict[str, int]:
    """Calls of each layer class (cell) while one `eqx.filter_jit` traces."""
    fn, model, x = make_case(kind, length, remat, mode)
    if grad:
        inner = fn
        fn = eqx.filter_grad(lambda m, x: jnp.sum(inner(m, x)))
    _calls.clear()
    eqx.filter_jit(fn).lower(model, x)
    return dict(_calls)


def table(lengths: list[int]) -> str:
    head = "| model | remat | pass | " + " | ".join(f"L={n}" for n in lengths)
    rows = [head + " |", "|---|---|---|" + "---:|" * len(lengths)]
    cases = REMATS + (('mode="loop"', "loop"),)
    for kind in ("Stacked", "Chain", "Recurrent"):
        for label, remat in cases:
            for grad in (False, True):
                mode = "loop" if remat == "loop" else "scan"
                cp = None if remat == "loop" else remat
                counts = [
                    max(count_calls(kind, n, cp, grad, mode).values()) for n in lengths
                ]
                rows.append(
                    f"| {kind} | {label} | {'grad' if grad else 'forward'} | "
                    + " | ".join(map(str, counts))
                    + " |"
                )
    return "\n".join(rows)


def transformer_trace_seconds(
    layers: int,
    dim: int = 256,
    batch: int = 8,
    seq: int = 64,
    repeats: int = 3,
    clock=time.perf_counter,
) -> float:
    model = eqx.filter_eval_shape(
        eqxscan.Stacked, lambda k: Block(dim, key=k), layers, key=jr.key(0)
    )
    params, static = eqx.partition(model, lambda a: isinstance(a, jax.ShapeDtypeStruct))
    x = jax.ShapeDtypeStruct((batch, seq, dim), jnp.float32)
    best = float("inf")
    for _ in range(repeats):

        def loss(params, x, y):
            return mse(eqx.combine(params, static)(x), y)

        step = jax.value_and_grad(loss)
        start = clock()
        jax.jit(step).trace(params, x, x)
        best = min(best, clock() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
    p.add_argument("--transformer-layers", type=int, default=64)
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time the trace by the wall clock or by this process's CPU time "
        "(steadier on a shared machine)",
    )
    p.add_argument("--no-table", action="store_true", help="trace time only")
    args = p.parse_args()
    print(f"jax {jax.__version__}, {jax.default_backend()}\n")
    if not args.no_table:
        print("Layer (cell) calls per trace of one eqx.filter_jit:\n")
        print(table(args.layers))
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    seconds = transformer_trace_seconds(args.transformer_layers, clock=clock)
    print(
        f"\nTransformer bench (D=256, B=8, T=64, L={args.transformer_layers}, "
        f"default options): jax.jit(value_and_grad(loss)).trace(...) best of 3 "
        f"({args.clock} clock): {seconds:.3f} s"
    )


if __name__ == "__main__":
    main()
