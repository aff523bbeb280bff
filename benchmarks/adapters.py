"""LoRA adapters (`eqxscan.adapters`) measured on CPU or any backend:

- memory: one base with `K` adapters against the base restacked per adapter
  (`K` full copies of the model, one per fine-tune): the arrays' bytes, and
  XLA's temporaries (`memory_analysis()`) of a forward pass over a batch in
  which each row uses its own adapter;
- training: an Adam step of LoRA against full fine-tuning of the same model,
  compile time, steady-state step time and the optimiser state's bytes;
- decoding: a step of a batch whose rows use different adapters against a
  batch using one adapter (and the base alone), KV caches updated in place;
- compiles: how many programs each step compiled over all its calls (counted
  with `jax.monitoring`), the mixed batches with a new mix of ids every call.

    python -m benchmarks.adapters
    python -m benchmarks.adapters --tiny

One process: run it alone on an accelerator. A measurement that does not fit in
the device's memory is reported as such (`does not fit`) and the next one run.
"""

import argparse
import collections
import math
import statistics
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxscan
from benchmarks.bench._measure import out_of_memory
from eqxscan import adapters


# XLA's compiles per jitted function name and their seconds, from jax's own event.
COMPILES: collections.Counter[str] = collections.Counter()
COMPILE_SECONDS: collections.defaultdict[str, float] = collections.defaultdict(float)


def _count_compile(event: str, duration_secs: float, **kwargs: str | int) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        name = str(kwargs.get("fun_name", "")).split("(")[-1].rstrip(")")
        COMPILES[name] += 1
        COMPILE_SECONDS[name] += duration_secs


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if eqx.is_array(x))


def _temp(fn, *args) -> int:
    memory = jax.jit(fn).lower(*args).compile().memory_analysis()
    assert memory is not None, "this backend reports no memory analysis"
    return memory.temp_size_in_bytes


def measure(dim: int, layers: int, rank: int, k: int, batch: int) -> dict[str, int]:
    base = eqxscan.StackedMLP(dim, layers, key=jax.random.key(0))
    model = adapters.add_lora(
        base, ["*.w1", "*.w2"], rank=rank, num_adapters=k, key=jax.random.key(1)
    )
    # K full copies, one row's weights picked by its id.
    copies = jax.tree.map(lambda a: jnp.stack([a] * k) if eqx.is_array(a) else a, base)
    arrays, static = eqx.partition(model, eqx.is_array)
    c_arrays, c_static = eqx.partition(copies, eqx.is_array)
    xs = jnp.ones((batch, dim))
    ids = jnp.arange(batch, dtype=jnp.int32) % k

    def lora(p, xs, ids):
        m = eqx.combine(p, static)
        return jax.vmap(lambda x, i: adapters.select(m, i)(x))(xs, ids)

    def restacked(p, xs, ids):
        def row(x, i):
            one = jax.tree.map(lambda a: a[i], p)
            return eqx.combine(one, c_static)(x)

        return jax.vmap(row)(xs, ids)

    return {
        "lora_bytes": _nbytes(model),
        "copies_bytes": _nbytes(copies),
        "lora_temp": _temp(lora, arrays, xs, ids),
        "copies_temp": _temp(restacked, c_arrays, xs, ids),
    }


class Runner:
    """A jitted step applied to its own outputs: `state` is threaded (and
    donated) from call to call; `args()` gives the other arguments of a call."""

    def __init__(self, fn: Callable, state: tuple, args: Callable[[], tuple]):
        self.fn, self.state, self.args = fn, state, args
        self.first_s = 0.0

    def __call__(self) -> None:
        self.state = jax.block_until_ready(self.fn(*self.state, *self.args()))

    def first(self) -> None:
        # Trace, compile and one call.
        start = time.perf_counter()
        self()
        self.first_s = time.perf_counter() - start


def _median_ms(runners: dict[str, Runner], repeats: int) -> dict[str, float]:
    """Each runner's median step time, the runners interleaved in every repeat so
    that the machine's load hits them alike."""
    for r in runners.values():
        r.first()
        r()  # warm up
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, r in runners.items():
            start = time.perf_counter()
            r()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def train_steps(dim: int, layers: int, rank: int, batch: int, repeats: int):
    """Adam steps of LoRA (`w1`, `w2` adapted, one adapter) and of full
    fine-tuning of the same `StackedMLP`: times, compile times, state bytes."""
    base = eqxscan.StackedMLP(dim, layers, key=jax.random.key(0))
    model = adapters.add_lora(base, ["*.w1", "*.w2"], rank=rank, key=jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (batch, dim))
    target = jnp.roll(x, 1, axis=-1)
    optimiser = optax.adam(1e-4)

    def runner(model, spec, name: str) -> tuple[Runner, optax.OptState]:
        params, static = eqx.partition(model, spec)
        state = optimiser.init(params)

        def step(params, state, x, target):
            def loss(p):
                return jnp.mean((eqx.combine(p, static)(x) - target) ** 2)

            grads = jax.grad(loss)(params)
            updates, state = optimiser.update(grads, state, params)
            return eqx.apply_updates(params, updates), state

        step.__name__ = name
        jitted = jax.jit(step, donate_argnums=(0, 1))
        return Runner(jitted, (params, state), lambda: (x, target)), state

    lora, lora_state = runner(model, adapters.trainable(model), "lora_train_step")
    full, full_state = runner(base, eqx.is_inexact_array, "full_train_step")
    ms = _median_ms({"lora": lora, "full": full}, repeats)
    return {
        "lora_ms": ms["lora"],
        "full_ms": ms["full"],
        "lora_first_s": lora.first_s,
        "full_first_s": full.first_s,
        "lora_xla_s": COMPILE_SECONDS["lora_train_step"],
        "full_xla_s": COMPILE_SECONDS["full_train_step"],
        "adapter_bytes": _nbytes(eqx.filter(model, adapters.trainable(model))),
        "lora_state_bytes": _nbytes(lora_state),
        "lora_moments_bytes": _nbytes(
            [a for a in jax.tree.leaves(lora_state) if a.ndim]
        ),
        "full_state_bytes": _nbytes(full_state),
        "model_bytes": _nbytes(base),
    }


class Attn(eqx.Module):
    """A decode layer: attention over its KV cache (`x @ wqkv`, `o @ wo`), then
    an MLP (`x @ w1`, `x @ w2`); every matrix is adapted."""

    wqkv: jax.Array
    wo: jax.Array
    w1: jax.Array
    w2: jax.Array
    heads: int = eqx.field(static=True)

    def __init__(self, dim: int, heads: int, *, key: jax.Array):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        init = lambda k, m, n: jax.random.normal(k, (m, n)) / math.sqrt(m)  # noqa: E731
        self.wqkv, self.wo = init(k1, dim, 3 * dim), init(k2, dim, dim)
        self.w1, self.w2 = init(k3, dim, 4 * dim), init(k4, 4 * dim, dim)
        self.heads = heads

    def __call__(self, x, cache, pos):
        s, d = x.shape
        e = d // self.heads
        q, k, v = (a.reshape(s, self.heads, e) for a in jnp.split(x @ self.wqkv, 3, -1))
        kc = jax.lax.dynamic_update_slice(cache[0], k, (pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(cache[1], v, (pos, 0, 0))
        seen = jnp.arange(kc.shape[0])[None] <= pos + jnp.arange(s)[:, None]
        scores = jnp.einsum("shd,thd->hst", q, kc) / math.sqrt(e)
        p = jax.nn.softmax(jnp.where(seen[None], scores, -1e30), -1)
        x = x + jnp.einsum("hst,thd->shd", p, vc).reshape(s, d) @ self.wo
        return x + jax.nn.gelu(x @ self.w1) @ self.w2, (kc, vc)


def _decoder(dim: int, layers: int, rank: int, k: int):
    """A stack of `Attn` layers, and the same with `k` adapters on every matrix
    (each with a nonzero `b`, so that the adapters change the output)."""
    heads = max(1, dim // 64)
    make = lambda key: Attn(dim, heads, key=key)  # noqa: E731
    stack = eqxscan.Stacked(make, layers, key=jax.random.key(0))
    targets = ["*.wqkv", "*.wo", "*.w1", "*.w2"]
    model = adapters.add_lora(
        stack, targets, rank=rank, num_adapters=k, key=jax.random.key(1)
    )
    is_lora = lambda x: isinstance(x, adapters.LoRA)  # noqa: E731
    bs = lambda m: [x.b for x in jax.tree.leaves(m, is_leaf=is_lora) if is_lora(x)]  # noqa: E731
    model = eqx.tree_at(bs, model, [jnp.full_like(b, 0.01) for b in bs(model)])
    return stack, model, heads


def decode_steps(
    dim: int, layers: int, rank: int, k: int, batch: int, length: int, repeats: int
):
    """A decode step (one token per row, at the middle of a cache of `length`)
    of `batch` rows: each row its own adapter (a new mix of ids every call), all
    rows one adapter, and the base without LoRAs. The caches are donated and
    each step's output is the next step's input."""
    stack, model, heads = _decoder(dim, layers, rank, k)
    arrays, static = eqx.partition(model, eqx.is_array)
    pos = jnp.int32(length // 2)

    def mixed_decode_step(cache, x, arrays, ids):
        m = eqx.combine(arrays, static)
        row = lambda i, t, c: adapters.select(m, i)(t, eqxscan.buffer(c), pos=pos)  # noqa: E731
        x, cache = jax.vmap(row)(ids, x, cache)
        return cache, x

    def single_decode_step(cache, x, arrays):
        m = adapters.select(eqx.combine(arrays, static), 0)
        x, cache = jax.vmap(lambda t, c: m(t, eqxscan.buffer(c), pos=pos))(x, cache)
        return cache, x

    def base_decode_step(cache, x, stack):
        x, cache = jax.vmap(lambda t, c: stack(t, eqxscan.buffer(c), pos=pos))(x, cache)
        return cache, x

    def start() -> tuple:
        shape = (batch, layers, length, heads, dim // heads)
        x = jax.random.normal(jax.random.key(2), (batch, 1, dim))
        return (jnp.zeros(shape), jnp.zeros(shape)), x

    mixes = iter(jax.random.split(jax.random.key(3), 2 * repeats + 2))
    new_ids = lambda: jax.random.randint(next(mixes), (batch,), 0, k, jnp.int32)  # noqa: E731
    runners = {
        "mixed": Runner(
            jax.jit(mixed_decode_step, donate_argnums=0),
            start(),
            lambda: (arrays, new_ids()),
        ),
        "single": Runner(
            jax.jit(single_decode_step, donate_argnums=0), start(), lambda: (arrays,)
        ),
        "base": Runner(
            jax.jit(base_decode_step, donate_argnums=0), start(), lambda: (stack,)
        ),
    }
    ms = _median_ms(runners, repeats)
    out = {f"{name}_ms": v for name, v in ms.items()}
    out["cache_bytes"] = _nbytes(start()[0])
    return out


def fits(measure: Callable[..., dict], *args: int) -> dict | None:
    """`measure(*args)`, or None (and a line saying so) when it runs out of
    memory."""
    try:
        return measure(*args)
    except Exception as e:
        if (message := out_of_memory(e)) is None:
            raise
        print(f"{measure.__name__}{args} does not fit: {message}")
        return None


def main() -> None:
    # This run's compiles only (a process may call main more than once).
    COMPILES.clear()
    COMPILE_SECONDS.clear()
    parser = argparse.ArgumentParser(description="LoRA adapters, measured.")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--decode-adapters", type=int, default=4)
    parser.add_argument("--cache-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--tiny", action="store_true", help="a smoke test")
    args = parser.parse_args()
    # Sizes and counts of 0 or less ran into tracebacks deep in the step.
    for name, value in vars(args).items():
        if any(
            type(v) is int and v < 1
            for v in (value if isinstance(value, list) else [value])
        ):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.tiny:
        args.dim, args.layers, args.rank, args.batch = 16, 2, 2, 4
        args.adapters, args.decode_batch, args.cache_length = [1, 2], 4, 8
        args.decode_adapters, args.repeats = 2, 2
    print(
        f"StackedMLP dim={args.dim} layers={args.layers}, w1 and w2 adapted, "
        f"rank={args.rank}, batch={args.batch}, float32, {jax.default_backend()}"
    )
    print(
        f"{'K':>3} {'LoRA MiB':>9} {'copies MiB':>11} {'LoRA temp MiB':>14} "
        f"{'copies temp MiB':>16}"
    )
    mib = 2.0**20
    for k in args.adapters:
        r = fits(measure, args.dim, args.layers, args.rank, k, args.batch)
        if r is None:
            continue
        print(
            f"{k:>3} {r['lora_bytes'] / mib:>9.2f} {r['copies_bytes'] / mib:>11.2f} "
            f"{r['lora_temp'] / mib:>14.2f} {r['copies_temp'] / mib:>16.2f}"
        )

    t = fits(train_steps, args.dim, args.layers, args.rank, args.batch, args.repeats)
    if t is not None:
        _print_train(t, args.repeats)
    d = fits(
        decode_steps,
        args.dim,
        args.layers,
        args.rank,
        args.decode_adapters,
        args.decode_batch,
        args.cache_length,
        args.repeats,
    )
    if d is not None:
        _print_decode(d, args.decode_batch, args.decode_adapters, args.cache_length)
    steps = ["lora_train_step", "full_train_step"]
    steps += ["mixed_decode_step", "single_decode_step", "base_decode_step"]
    print(
        f"\ncompiles over {args.repeats + 2} calls each (the mixed decode step "
        "with new ids every call): " + ", ".join(f"{s} {COMPILES[s]}" for s in steps)
    )


def _print_train(t: dict, repeats: int) -> None:
    mib = 2.0**20
    print(
        f"\nAdam train step, the same model: LoRA (one adapter) against full "
        f"fine-tuning, median of {repeats} interleaved steps"
    )
    head = f"{'step ms':>8} {'first call s':>13} {'XLA compile s':>14} "
    print(f"{'':>5} {head}{'Adam state MiB':>15} {'trained MiB':>12}")
    for name, trained in (("lora", t["adapter_bytes"]), ("full", t["model_bytes"])):
        print(
            f"{name:>5} {t[name + '_ms']:>8.2f} {t[name + '_first_s']:>13.2f} "
            f"{t[name + '_xla_s']:>14.2f} "
            f"{t[name + '_state_bytes'] / mib:>15.3f} {trained / mib:>12.3f}"
        )
    print(
        f"LoRA/full step: {t['lora_ms'] / t['full_ms']:.2f}x; LoRA's Adam state: "
        f"{t['lora_moments_bytes'] / t['adapter_bytes']:.2f}x the adapters' "
        f"bytes (+ {t['lora_state_bytes'] - t['lora_moments_bytes']} B, the step count)"
    )


def _print_decode(d: dict, batch: int, k: int, length: int) -> None:
    mib = 2.0**20
    print(
        f"\ndecode step, one token per row, B={batch}, "
        f"K={k}, cache {length} positions "
        f"({d['cache_bytes'] / mib:.2f} MiB, donated), every matrix adapted"
    )
    print(f"{'':>7} {'step ms':>8}")
    for name in ("mixed", "single", "base"):
        print(f"{name:>7} {d[name + '_ms']:>8.3f}")
    print(f"mixed/single: {d['mixed_ms'] / d['single_ms']:.2f}x")


if __name__ == "__main__":
    main()
