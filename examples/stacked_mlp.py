"""Train a scanned residual MLP (`eqxscan.StackedMLP`) on a synthetic regression.

Fits a random two-layer "teacher" network with Adam, then compares the scanned
model (`mode="scan"`, the default) against the same weights run as an unrolled
Python loop (`mode="loop"`): compile time and steady-state train-step time.

    python examples/stacked_mlp.py [--steps 300] [--layers 16] [--dim 64]
    python examples/stacked_mlp.py --tiny   # every step at the smallest sizes

`--tiny` (what the tests run) keeps every step but trains 60 steps of a 4-layer,
16-wide model on batches of 64 and times 3 repeats; flags given with it still
apply.
"""

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
from tqdm import tqdm

import eqxscan


def make_teacher(key, dim):
    """A random two-layer network to regress onto."""
    ka, kb = jr.split(key)
    a = jr.normal(ka, (dim, 2 * dim)) / dim**0.5
    b = jr.normal(kb, (2 * dim, dim)) / (2 * dim) ** 0.5
    return lambda x: jnp.tanh(x @ a) @ b


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def make_step(optimizer):
    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), opt_state, loss

    return step


TINY = dict(steps=60, layers=4, dim=16, batch=64, repeats=3)  # --tiny


def compare_train_steps(models, optimizer, x, y, repeats=15):
    """AOT compile time of each model's train step, then steady-state step times
    measured interleaved (so machine noise hits every model alike)."""
    step = make_step(optimizer)
    compiled, compile_s, args = {}, {}, {}
    for name, model in models.items():
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
        args[name] = (model, opt_state, x, y)
        t0 = time.perf_counter()
        compiled[name] = step.lower(*args[name]).compile()
        compile_s[name] = time.perf_counter() - t0
        jax.block_until_ready(compiled[name](*args[name]))  # warm-up
    times = {name: [] for name in models}
    for _ in range(repeats):
        for name in models:
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](*args[name]))
            times[name].append(time.perf_counter() - t0)
    return {n: (compile_s[n], statistics.median(times[n])) for n in models}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=15, help="timed steps")
    parser.add_argument("--tiny", action="store_true", help="the smallest sizes")
    args = parser.parse_args(argv)
    if args.tiny:
        parser.set_defaults(**TINY)
        args = parser.parse_args(argv)
    if args.steps < 1 or args.layers < 1 or args.dim < 1 or args.batch < 1:
        parser.error("--steps, --layers, --dim and --batch must be positive")

    kteacher, kdata, kmodel, kval = jr.split(jr.key(args.seed), 4)
    teacher = make_teacher(kteacher, args.dim)
    x_all = jr.normal(kdata, (8192, args.dim))
    x_val = jr.normal(kval, (1024, args.dim))
    y_all, y_val = teacher(x_all), teacher(x_val)
    model = eqxscan.StackedMLP(args.dim, args.layers, key=kmodel)
    # Trivial baseline: predict the training mean.
    baseline = float(jnp.mean((y_val - y_all.mean(0)) ** 2))
    print(
        f"StackedMLP: L={args.layers}, D={args.dim}, "
        f"w1 {model.blocks.layers.w1.shape}, remat={model.blocks.remat!r}"
    )
    print(f"baseline (predict the mean) val MSE: {baseline:.4f}")

    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = make_step(optimizer)
    batches = jr.randint(jr.key(args.seed + 1), (args.steps, args.batch), 0, 8192)
    with tqdm(range(args.steps), desc="training", unit="step") as bar:
        for i in bar:
            idx = batches[i]
            model, opt_state, loss = step(model, opt_state, x_all[idx], y_all[idx])
            if i % 25 == 0 or i == args.steps - 1:
                bar.set_postfix(loss=f"{float(loss):.4f}")
    final = float(loss_fn(model, x_val, y_val))
    print(f"final val MSE: {final:.4f} ({final / baseline:.1%} of the baseline)")

    print("\ntrain step (value_and_grad + Adam), same weights, same shapes:")
    x, y = x_all[: args.batch], y_all[: args.batch]
    models = {
        mode: eqx.tree_at(
            lambda m: m.blocks, model, model.blocks.with_options(mode=mode)
        )
        for mode in ("scan", "loop")
    }
    results = compare_train_steps(models, optimizer, x, y, args.repeats)
    for name, (c, s) in results.items():
        print(f"  {name:5s} compile {c:6.2f} s   step {s * 1e3:7.2f} ms (median)")
    (cs, ss), (cl, sl) = results["scan"], results["loop"]
    print(f"  scan/loop: compile {cs / cl:.2f}x, step {ss / sl:.2f}x")
    (choice,) = eqxscan.explain_auto(model, x)
    if choice.unroll is True:  # a short stack of small layers: the loop's program
        print(f"  (at this size the default unrolls the scan: {choice.reason})")
    return final, baseline


if __name__ == "__main__":
    main()
