"""One KV-cache decode step through L layers, seven ways: XLA temp and alias
bytes, bytes accessed, compile time and step time (interleaved repeats,
median), the cache donated in every row.

- `in place`: `stack(x, eqxscan.buffer(cache), pos=pos)`, each layer writing
  its new row with `jax.lax.dynamic_update_slice` (on CPU the layer reads a
  copy of its updated slice: `reads="auto"`);
- `in place, view`: the same with `eqxscan.buffer(cache, reads="view")`, the
  layer reading its slice straight from the stacked cache;
- `ys`: the cache as `eqxscan.per_layer(cache)` and the new cache as the
  scan's `ys` (`stack.scan`);
- `scan, slice`: `lax.scan` by hand, the stacked cache in the carry, layer
  `i`'s whole slice read and written back;
- `scan, rows`: `lax.scan` by hand, only the new row written into the stacked
  cache;
- `loop`: a Python loop over unstacked layers and a list of per-layer caches
  (unrolled at trace time);
- `loop mode`: the same stack with `mode="loop"`.

A batch of sequences is decoded as a server does: the step `jax.vmap`-ed over
the batch, each sequence at its own position. Every variant's cache is on the
device at once; a size whose caches or steps do not fit in the device's memory is
reported as such (`does not fit`) and the next one measured. One process: run it
alone on an accelerator.

    python benchmarks/decode.py --layers 16 32 64 --length 2048 8192 --batch 1 8
    python benchmarks/decode.py --layers 16 --length 2048 --batch 1 --hlo
    python benchmarks/decode.py --layers 16 32 64 --length 2048 --batch 1 \
        --variants "in place" --compiles 5 --repeats 1
"""

import argparse
import math
import re
import statistics
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

import eqxscan


class Block(eqx.Module):
    """Pre-norm-free attention + MLP block decoding one token against its cache."""

    wqkv: jax.Array
    wo: jax.Array
    w1: jax.Array
    w2: jax.Array
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, *, key: jax.Array):
        k1, k2, k3, k4 = jr.split(key, 4)
        self.wqkv = jr.normal(k1, (dim, 3 * dim)) / math.sqrt(dim)
        self.wo = jr.normal(k2, (dim, dim)) / math.sqrt(dim)
        self.w1 = jr.normal(k3, (dim, 4 * dim)) / math.sqrt(dim)
        self.w2 = jr.normal(k4, (4 * dim, dim)) / math.sqrt(4 * dim)
        self.heads = heads

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        d = x.shape[-1]
        q, k, v = jnp.split(x @ self.wqkv, 3, -1)
        return tuple(a.reshape(1, self.heads, d // self.heads) for a in (q, k, v))  # pyright: ignore[reportReturnType]

    def attend(self, x, q, kc, vc, pos):
        t, e = kc.shape[0], kc.shape[-1]
        s = jnp.einsum("shd,thd->hst", q, kc) / math.sqrt(e)
        s = jnp.where(jnp.arange(t)[None, None] <= pos, s, -1e30)
        o = jnp.einsum("hst,thd->shd", jax.nn.softmax(s, -1), vc)
        x = x + o.reshape(1, -1) @ self.wo
        return x + jax.nn.gelu(x @ self.w1) @ self.w2

    def __call__(self, x, cache, pos):
        kc, vc = cache
        q, k, v = self.qkv(x)
        kc = jax.lax.dynamic_update_slice(kc, k, (pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v, (pos, 0, 0))
        return self.attend(x, q, kc, vc, pos), (kc, vc)


def variants(stack: eqxscan.Stacked) -> dict[str, tuple[Callable, bool]]:
    """name -> (decode step of one sequence `fn(model, x, pos, cache)`, whether
    it takes a list of per-layer caches and unstacked layers)."""
    w = stack.layers
    n = stack.num_layers

    def in_place(s, x, pos, cache):
        return s(x, eqxscan.buffer(cache), pos=pos)

    def in_place_view(s, x, pos, cache):
        return s(x, eqxscan.buffer(cache, reads="view"), pos=pos)

    def ys(s, x, pos, cache):
        def one(layer, x, cache, pos):
            return layer(x, cache, pos)

        return s.scan(x, eqxscan.per_layer(cache), pos, method=one)

    def scan_slice(s, x, pos, cache):
        dyn, static = eqx.partition(s.layers, eqx.is_array)

        def step(c, a):
            (x, cache), (d, i) = c, a
            sl = jax.tree.map(
                lambda b: jax.lax.dynamic_index_in_dim(b, i, 0, False), cache
            )
            x, sl = eqx.combine(d, static)(x, sl, pos)
            cache = jax.tree.map(
                lambda b, s: jax.lax.dynamic_update_index_in_dim(b, s, i, 0), cache, sl
            )
            return (x, cache), None

        return jax.lax.scan(step, (x, cache), (dyn, jnp.arange(n)))[0]

    def scan_rows(s, x, pos, cache):
        dyn, static = eqx.partition(s.layers, eqx.is_array)

        def step(c, a):
            (x, (kc, vc)), (d, i) = c, a
            layer = eqx.combine(d, static)
            q, k, v = layer.qkv(x)
            kc = jax.lax.dynamic_update_slice(kc, k[None], (i, pos, 0, 0))
            vc = jax.lax.dynamic_update_slice(vc, v[None], (i, pos, 0, 0))
            sl = [jax.lax.dynamic_index_in_dim(b, i, 0, False) for b in (kc, vc)]
            return (layer.attend(x, q, *sl, pos), (kc, vc)), None

        return jax.lax.scan(step, (x, cache), (dyn, jnp.arange(n)))[0]

    def loop(layers, x, pos, caches):
        out = []
        for layer, c in zip(layers, caches):
            x, c = layer(x, c, pos)
            out.append(c)
        return x, out

    loop_mode = stack.with_options(mode="loop")
    del w
    return {
        "in place": (in_place, False),
        "in place, view": (in_place_view, False),
        "loop mode": (lambda s, x, p, c: in_place(loop_mode, x, p, c), False),
        "ys": (ys, False),
        "scan, slice": (scan_slice, False),
        "scan, rows": (scan_rows, False),
        "loop": (loop, True),
    }


def compiled_steps(
    num_layers: int,
    length: int,
    batch: int,
    dim: int,
    heads: int,
    only: list[str] | None = None,
    compiles: int = 1,
) -> dict[str, tuple]:
    """name -> (compiled step, model, cache, x, pos, compile seconds): the
    variants named in `only` (all by default), each compiled `compiles` times
    from a fresh trace, the median time kept."""
    stack = eqxscan.Stacked(
        lambda k: Block(dim, heads, key=k), num_layers, key=jr.key(0)
    )
    e = dim // heads
    x = jr.normal(jr.key(1), (batch, 1, dim))
    pos = jnp.arange(batch, dtype=jnp.int32) * 7 + length // 2
    compiled = {}
    known = variants(stack)
    if unknown := sorted(set(only or ()) - set(known)):
        raise SystemExit(f"decode.py: no variant {unknown}; there are {list(known)}")
    for name, (fn, unrolled) in known.items():
        if only is not None and name not in only:
            continue
        model = stack.unstack() if unrolled else stack
        shape = (batch, length, heads, e)
        if unrolled:
            cache = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(num_layers)]
        else:
            cache = (jnp.zeros((batch, num_layers, *shape[1:])),) * 2
            cache = jax.tree.map(jnp.copy, cache)
        seconds = []
        for _ in range(compiles):
            jax.clear_caches()
            step = jax.jit(
                jax.vmap(fn, in_axes=(None, 0, 0, 0), out_axes=0), donate_argnums=3
            )
            t0 = time.perf_counter()
            exe = step.lower(model, x, pos, cache).compile()
            seconds.append(time.perf_counter() - t0)
        compiled[name] = (exe, model, cache, x, pos, statistics.median(seconds))
    return compiled


def measure(
    num_layers: int,
    length: int,
    batch: int,
    dim: int,
    heads: int,
    repeats: int,
    only: list[str] | None = None,
    compiles: int = 1,
):
    compiled = compiled_steps(num_layers, length, batch, dim, heads, only, compiles)
    rows = []
    for name, (exe, _, _, _, _, compile_s) in compiled.items():
        mem = exe.memory_analysis()
        cost = exe.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rows.append(
            dict(
                name=name,
                temp=mem.temp_size_in_bytes,
                alias=mem.alias_size_in_bytes,
                bytes=cost.get("bytes accessed", 0.0),
                compile=compile_s,
            )
        )
    times = {name: [] for name in compiled}
    state = {name: c[2] for name, c in compiled.items()}
    for r in range(repeats + 2):
        for name, (exe, model, _, x, pos, _) in compiled.items():
            t0 = time.perf_counter()
            y, state[name] = exe(model, x, pos, state[name])
            jax.block_until_ready(state[name])
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    for row in rows:
        row["step"] = statistics.median(times[row["name"]])
    return rows


def out_of_memory(error: Exception) -> str | None:
    """The first line of `error` when it says that the device (or the host) ran
    out of memory (XLA's `RESOURCE_EXHAUSTED`), else `None`: such a size is
    reported as not fitting and the next one measured."""
    text = f"{type(error).__name__}: {error}"
    if isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text:
        return text.strip().splitlines()[0][:200]
    return None


def step_copies(exe) -> list[str]:
    """The copies in a compiled step's optimised HLO: fusions with no dot that
    slice dynamically, transpose or copy, and plain copies/transposes; each as
    its output type, with the computation it sits in (a scan body is a while
    loop's body, run once per layer)."""
    text = exe.as_text()
    comps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            current = m.group(1)
            comps[current] = []
        elif current:
            comps[current].append(line)
    copies = []
    for name, lines in comps.items():
        if name.startswith("fused"):  # inside a fusion listed below
            continue
        for line in lines:
            m = re.search(
                r"= (\w+\[[\d,]*\])\{[^}]*\} fusion\(.*calls=%?([\w.\-]+)", line
            )
            if m:
                body = "\n".join(comps.get(m.group(2), []))
                moves = any(
                    op in body for op in ("dynamic-slice", "transpose", " copy(")
                )
                if moves and " dot(" not in body and "dynamic-update-slice" not in body:
                    copies.append(f"{name}: fusion {m.group(1)}")
            m = re.search(r"= (\w+\[[\d,]*\])\{[^}]*\} (copy|transpose)\(", line)
            if m:
                copies.append(f"{name}: {m.group(2)} {m.group(1)}")
    return copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # On an accelerator a size takes about 45 s (seven compiles; a TPU v5e):
    # there the defaults are a server's batch at the shallowest and deepest stack.
    accelerator = jax.default_backend() != "cpu"
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=[16, 64] if accelerator else [16, 32, 64],
    )
    parser.add_argument("--length", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument(
        "--batch", type=int, nargs="+", default=[8] if accelerator else [1, 8]
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--variants",
        nargs="+",
        help="only these variants (the loop is always run: ratios are to it)",
    )
    parser.add_argument(
        "--compiles",
        type=int,
        default=1,
        help="compile each step this many times, from a fresh trace (median)",
    )
    parser.add_argument(
        "--hlo",
        action="store_true",
        help="print the copies in each variant's optimised step and stop",
    )
    args = parser.parse_args()
    # Sizes and counts of 0 or less ran into tracebacks deep in the step.
    for name, value in vars(args).items():
        if any(
            type(v) is int and v < 1
            for v in (value if isinstance(value, list) else [value])
        ):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.hlo:
        for name, (exe, *_) in compiled_steps(
            args.layers[0], args.length[0], args.batch[0], args.dim, args.heads
        ).items():
            print(f"{name}:")
            for line in step_copies(exe):
                print(f"  {line}")
        return
    mib = 2**20
    print(
        f"jax {jax.__version__}, {jax.devices()[0].platform}, "
        f"D={args.dim}, H={args.heads}"
    )
    print(
        "| L | T | B | variant | cache MiB | temp MiB | alias MiB | bytes accessed MiB "
        "| bytes / loop | step ms | step / loop | compile s |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for num_layers in args.layers:
        for length in args.length:
            for batch in args.batch:
                only = None if args.variants is None else [*args.variants, "loop"]
                try:
                    rows = measure(
                        num_layers,
                        length,
                        batch,
                        args.dim,
                        args.heads,
                        args.repeats,
                        only,
                        args.compiles,
                    )
                except Exception as e:
                    if (message := out_of_memory(e)) is None:
                        raise
                    print(
                        f"| {num_layers} | {length} | {batch} | does not fit: "
                        f"{message} |",
                        flush=True,
                    )
                    continue
                loop = next(r for r in rows if r["name"] == "loop")
                cache = 2 * 4 * num_layers * batch * length * args.dim
                for r in rows:
                    print(
                        f"| {num_layers} | {length} | {batch} | {r['name']} "
                        f"| {cache / mib:.0f} | {r['temp'] / mib:.1f} "
                        f"| {r['alias'] / mib:.0f} | {r['bytes'] / mib:.1f} "
                        f"| {r['bytes'] / loop['bytes']:.2f} | {r['step'] * 1e3:.1f} "
                        f"| {r['step'] / loop['step']:.2f} | {r['compile']:.2f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
