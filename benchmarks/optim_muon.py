"""Muon on stacked layers: training-step time of batched Muon on the stacked model
against Muon on the same layers kept in a list and plain AdamW on the stacked
model, and how far batched Muon drifts from list Muon after 20 steps.

    python benchmarks/optim_muon.py [--layers 16] [--dim 256] [--batch 256]
                                    [--repeats 7] [--inner 3] [--out FILE]

The model is `eqxscan.StackedMLP(dim, layers)`; a step is loss, gradient,
optimiser update and `eqx.apply_updates`, jitted, on a `[batch, dim]` input.
Besides whole steps it times the optimiser update alone (gradients given), since
Newton–Schulz costs the same whatever the batch while the forward and backward
passes grow with it. Each repeat runs the variants in a rotated order after a
warm-up; the tables show medians. Prints Markdown (and writes it to `--out`).
"""

import argparse
import os
import statistics
import time


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import eqxscan  # noqa: E402


def _forward(model, x):
    return model(x)


def _forward_list(blocks, x):
    for block in blocks:
        x = block(x)
    return x


def variants(layers: int, dim: int):
    model = eqxscan.StackedMLP(dim, layers, key=jax.random.key(0))
    listed = model.blocks.unstack()
    return {
        "batched Muon, stacked": (eqxscan.optim.muon(1e-3), model, _forward),
        "optax Muon, list of layers": (
            optax.contrib.muon(1e-3),
            listed,
            _forward_list,
        ),
        "adamw, stacked": (optax.adamw(1e-3), model, _forward),
    }


def _bind(optimiser, model, forward, x, y):
    """A jitted training step, a jitted update alone, and their first state."""

    def loss(m):
        return jnp.mean((forward(m, x) - y) ** 2)

    params = eqx.filter(model, eqx.is_inexact_array)
    state = optimiser.init(params)

    @eqx.filter_jit
    def step(m, s):
        grads = eqx.filter_grad(loss)(m)
        updates, s = optimiser.update(grads, s, eqx.filter(m, eqx.is_inexact_array))
        return eqx.apply_updates(m, updates), s

    @eqx.filter_jit
    def update(g, s, p):
        return optimiser.update(g, s, p)

    grads = eqx.filter_jit(eqx.filter_grad(loss))(model)
    return step, update, state, grads, params


def _timed(fn, args: tuple, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    kx, ky = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (args.batch, args.dim))
    y = jax.random.normal(ky, (args.batch, args.dim))
    bound = {
        name: (_bind(opt, model, fwd, x, y), model)
        for name, (opt, model, fwd) in variants(args.layers, args.dim).items()
    }

    # Warm-up (compiles), and the drift after `steps` steps from the same start.
    finals = {}
    for name, ((step, update, state, grads, params), model) in bound.items():
        jax.block_until_ready(update(grads, state, params))
        m, s = model, state
        for _ in range(args.steps):
            m, s = step(m, s)
        finals[name] = jax.block_until_ready(m)
    batched = finals["batched Muon, stacked"].blocks.unstack()
    listed = finals["optax Muon, list of layers"]
    drift = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(
            jax.tree.leaves(eqx.filter(batched, eqx.is_array)),
            jax.tree.leaves(eqx.filter(listed, eqx.is_array)),
            strict=True,
        )
    )

    names = list(bound)
    steps = {n: [] for n in names}
    updates = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            (step, update, state, grads, params), model = bound[name]
            steps[name].append(_timed(step, (model, state), args.inner))
            updates[name].append(_timed(update, (grads, state, params), args.inner))

    adamw_step = statistics.median(steps["adamw, stacked"])
    adamw_update = statistics.median(updates["adamw, stacked"])
    lines = [
        f"L={args.layers}, D={args.dim}, batch {args.batch}, "
        f"{jax.devices()[0].platform.upper()}, one process; medians of "
        f"{args.repeats} rotated repeats of {args.inner} calls",
        "",
        "| optimiser | step (ms) | step / adamw | update alone (ms) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in names:
        t, u = statistics.median(steps[name]), statistics.median(updates[name])
        lines.append(
            f"| {name} | {1e3 * t:.1f} | {t / adamw_step:.2f}x | {1e3 * u:.2f} |"
        )
    muon_update = statistics.median(updates["batched Muon, stacked"])
    forward_backward = adamw_step - adamw_update
    # Batch from which batched Muon's step is within 1.1x of AdamW's, taking the
    # forward and backward time as linear in the batch.
    needed = 10 * (muon_update - adamw_update) / forward_backward * args.batch
    lines += [
        "",
        f"Max abs parameter difference, batched Muon vs list Muon, after "
        f"{args.steps} steps: {drift:.2e}",
        f"Batch at which batched Muon's step would be 1.1x AdamW's (forward and "
        f"backward taken as linear in the batch): about {needed:.0f}",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
