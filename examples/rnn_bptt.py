"""Train a recurrent network with backpropagation through time on the adding problem.

Each input sequence has two channels: a random value in [0, 1) and a marker that is
1 at exactly two time steps. The target is the sum of the two marked values, read
out from the final hidden state, so the gradient must travel back through time to
the marked steps. Sequences have random lengths and are padded to a common length;
the padding is masked, so it leaves the final state unchanged.

The trivial baseline predicts 1.0 (the mean target) and scores 1/6 ~= 0.167 MSE.

    python examples/rnn_bptt.py                 # GRU, under a minute on 2 CPU cores
    python examples/rnn_bptt.py --cell lstm --steps 3000 --plot loss.png
    python examples/rnn_bptt.py --tiny          # every check at the smallest sizes

`--tiny` (what the tests run) keeps every step and check below but shortens the
sequences (T=10), the hidden state (16), the batch (32), the gradient check (2
directions) and the timing (3 repeats); the default steps become 150.

What it shows:

1. `eqxscan.Recurrent` runs a cell over time with `jax.lax.scan`; `jax.vmap`
   batches it; `jax.grad` through it is backpropagation through time (BPTT).
2. Before training, the BPTT gradient is checked against the gradient of a Python
   loop over time and against central finite differences, in float64.
3. Training with optax Adam; baseline and final loss.
4. Forward timing of `lax.scan` vs a Python loop vs `lax.fori_loop`.
"""

import argparse
import functools
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, PRNGKeyArray
from tqdm import tqdm

import eqxscan


LENGTH = 30  # padded sequence length T
HIDDEN = 32
BATCH = 64
TINY = {"length": 10, "hidden": 16, "batch": 32, "steps": 150}  # --tiny
LEARNING_RATE = 1e-2
CLIP_NORM = 1.0  # global gradient-norm clipping, the usual guard for RNNs
BASELINE = 1 / 6  # E[(a + b - 1)^2] for a, b ~ U(0, 1): always predicting 1.0
DEFAULT_STEPS = {"elman": 3000, "gru": 1000, "lstm": 1000}
CELLS = {"elman": eqxscan.ElmanCell, "gru": eqx.nn.GRUCell, "lstm": eqx.nn.LSTMCell}


# One compiled program per size (rather than a dozen small ones, op by op).
@functools.partial(jax.jit, static_argnums=(1, 2))
def make_batch(
    key: PRNGKeyArray, size: int, length: int = LENGTH
) -> tuple[Float[Array, "B T 2"], Bool[Array, "B T"], Float[Array, " B"]]:
    """`size` adding-problem sequences of lengths in [T/2, T], padded to T."""
    k_val, k_len, k_first, k_second = jr.split(key, 4)
    values = jr.uniform(k_val, (size, length))
    lengths = jr.randint(k_len, (size,), length // 2, length + 1)
    # One marker in each half of the valid part of the sequence.
    half = lengths // 2
    first = jr.randint(k_first, (size,), 0, half)
    second = jr.randint(k_second, (size,), half, lengths)
    t = jnp.arange(length)
    marked = (t == first[:, None]) | (t == second[:, None])
    xs = jnp.stack([values, marked.astype(values.dtype)], axis=-1)
    mask = t < lengths[:, None]
    targets = jnp.sum(jnp.where(marked, values, 0), axis=-1)
    return xs, mask, targets


class Model(eqx.Module):
    rnn: eqxscan.Recurrent
    head: eqx.nn.Linear

    def __init__(self, cell: str, hidden: int = HIDDEN, *, key: PRNGKeyArray):
        k_cell, k_head = jr.split(key)
        self.rnn = eqxscan.Recurrent(CELLS[cell](2, hidden, key=k_cell))
        self.head = eqx.nn.Linear(hidden, "scalar", key=k_head)

    def with_rnn_options(self, **options) -> "Model":
        return eqx.tree_at(lambda m: m.rnn, self, self.rnn.with_options(**options))

    def h0(self):
        zeros = jnp.zeros(self.head.in_features, self.head.weight.dtype)
        # LSTMCell carries (h, c); the others carry h.
        return (zeros, zeros) if isinstance(self.rnn.cell, eqx.nn.LSTMCell) else zeros

    def __call__(self, xs: Float[Array, "T 2"], mask: Bool[Array, " T"]) -> Array:
        h_T, _ = self.rnn(self.h0(), xs, mask=mask)
        return self.head(h_T[0] if isinstance(h_T, tuple) else h_T)


def loss_fn(model: Model, xs: Array, mask: Array, targets: Array) -> Array:
    # One sequence per example; jax.vmap(model) turns it into a batch.
    predictions = jax.vmap(model)(xs, mask)
    return jnp.mean((predictions - targets) ** 2)


def max_rel_err(a, b) -> float:
    """max |a - b| / max |b|, over the array leaves of two pytrees."""
    return max(
        float(np.max(np.abs(x - y)) / (np.max(np.abs(y)) + 1e-30))
        for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True)
    )


def gradient_check(
    model: Model, key: PRNGKeyArray, directions: int = 8, length: int = 12
) -> None:
    """BPTT (lax.scan) vs BPTT through a Python loop vs central finite differences,
    all in float64 on a few short sequences."""
    # Finite differences need float64; enable it only inside this block.
    with jax.enable_x64(True):
        model = jtu.tree_map(
            lambda a: jnp.asarray(a, jnp.float64) if eqx.is_inexact_array(a) else a,
            model,
        )
        xs, mask, targets = make_batch(key, 4, length=length)
        xs, targets = xs.astype(jnp.float64), targets.astype(jnp.float64)
        params, static = eqx.partition(model, eqx.is_inexact_array)
        # unroll=1: a lax.scan at any length (the default unrolls a short one,
        # which would compare the loop's program with itself).
        loss = lambda p, mode="scan": loss_fn(
            eqx.combine(p, static).with_rnn_options(mode=mode, unroll=1),
            xs,
            mask,
            targets,
        )

        @jax.jit
        def bptt(params):
            return jax.grad(loss)(params), jax.grad(loss)(params, "loop")

        @jax.jit
        def finite_differences(params, v):
            # (L(p + eps v) - L(p - eps v)) / 2 eps: the derivative along v.
            shift = lambda s: jtu.tree_map(lambda p, d: p + s * eps * d, params, v)
            return (loss(shift(1)) - loss(shift(-1))) / (2 * eps)

        eps = 1e-6
        g_scan, g_loop = bptt(params)
        leaves, treedef = jtu.tree_flatten(params)
        fd_err = 0.0
        for k in jr.split(jr.fold_in(key, 1), directions):
            # A random unit direction v in parameter space.
            v = [
                jr.normal(kk, a.shape, a.dtype)
                for kk, a in zip(jr.split(k, len(leaves)), leaves)
            ]
            norm = jnp.sqrt(sum(jnp.sum(x**2) for x in v))
            v = jtu.tree_unflatten(treedef, [x / norm for x in v])
            exact = sum(
                jnp.vdot(g, d)
                for g, d in zip(jtu.tree_leaves(g_scan), jtu.tree_leaves(v))
            )
            fd = finite_differences(params, v)
            fd_err = max(fd_err, float(jnp.abs(fd - exact) / jnp.abs(exact)))
        loop_err = max_rel_err(g_scan, g_loop)

    print("Gradient check in float64: BPTT through lax.scan (eqxscan.Recurrent) vs")
    print(f"  BPTT through a Python loop       max rel err {loop_err:8.1e}")
    print(
        f"  central finite differences       max rel err {fd_err:8.1e}"
        f"  ({directions} random directions, eps {eps:g})"
    )
    assert loop_err < 1e-10 and fd_err < 1e-6, "gradient check failed"


def train(
    model: Model,
    steps: int,
    key: PRNGKeyArray,
    batch: int = BATCH,
    length: int = LENGTH,
) -> tuple[Model, list[float]]:
    optimiser = optax.chain(
        optax.clip_by_global_norm(CLIP_NORM), optax.adam(LEARNING_RATE)
    )
    opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, key):
        xs, mask, targets = make_batch(key, batch, length)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, xs, mask, targets)
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    with tqdm(range(steps), desc="training", unit="step", leave=False) as bar:
        for i in bar:
            model, opt_state, loss = step(model, opt_state, jr.fold_in(key, i))
            losses.append(float(loss))
            if i % 50 == 0 or i == steps - 1:
                bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
    return model, losses


def time_forward(
    model: Model,
    key: PRNGKeyArray,
    repeats: int = 50,
    batch: int = BATCH,
    length: int = LENGTH,
) -> None:
    """Compile time and steady time of one batched forward pass over time."""
    xs, mask, _ = make_batch(key, batch, length)
    cell, h0 = model.rnn.cell, model.h0()

    def with_scan(xs, mask):
        return jax.vmap(lambda x, m: model.rnn(h0, x, mask=m))(xs, mask)

    def with_python_loop(xs, mask):
        # The same cell, traced T times: the program grows with T.
        loop = model.with_rnn_options(mode="loop").rnn
        return jax.vmap(lambda x, m: loop(h0, x, mask=m))(xs, mask)

    def with_fori_loop(xs, mask):
        def one(x, m):
            def body(t, state):
                h, hs = state
                new = cell(x[t], h)
                h = jtu.tree_map(lambda a, b: jnp.where(m[t], a, b), new, h)
                hs = jtu.tree_map(lambda buf, a: buf.at[t].set(a), hs, h)
                return h, hs

            # fori_loop carries only state: preallocate the per-step outputs.
            hs = jtu.tree_map(lambda a: jnp.zeros((length, *a.shape), a.dtype), h0)
            return jax.lax.fori_loop(0, length, body, (h0, hs))

        return jax.vmap(one)(xs, mask)

    print(
        f"Forward pass, batch {batch}, T={length} (median of {repeats} after warm-up):"
    )
    print(f"  {'':18}{'compile':>10}{'steady':>12}")
    results = {}
    for name, fn in [
        ("lax.scan", with_scan),
        ("Python loop", with_python_loop),
        ("lax.fori_loop", with_fori_loop),
    ]:
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(xs, mask).compile()
        compile_s = time.perf_counter() - start
        jax.block_until_ready(compiled(xs, mask))  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(xs, mask))
            times.append(time.perf_counter() - start)
        results[name] = compiled(xs, mask)
        print(f"  {name:18}{compile_s:9.2f}s{np.median(times) * 1e3:10.2f}ms")
    reference = results["lax.scan"]
    for name in ("Python loop", "lax.fori_loop"):
        assert max_rel_err(results[name], reference) < 1e-5, f"{name} disagrees"


def plot(losses: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = 25
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(losses, alpha=0.3, label="batch loss")
    ax.semilogy(np.arange(window - 1, len(losses)), smooth, label=f"mean of {window}")
    ax.axhline(BASELINE, color="k", linestyle="--", label="baseline (predict 1.0)")
    ax.set_xlabel("training step")
    ax.set_ylabel("MSE")
    ax.set_title("Adding problem, BPTT with eqxscan.Recurrent")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        help=f"training steps (default {DEFAULT_STEPS['gru']}; the ungated Elman "
        f"cell learns slower: {DEFAULT_STEPS['elman']})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cell", choices=sorted(CELLS), default="gru")
    parser.add_argument("--plot", metavar="PATH", help="write the loss curve as PNG")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="every check at the smallest sizes, in seconds (what the tests run)",
    )
    args = parser.parse_args()
    if args.tiny:
        length, hidden, batch = TINY["length"], TINY["hidden"], TINY["batch"]
        directions, check_length, repeats = 2, 6, 3
    else:
        length, hidden, batch = LENGTH, HIDDEN, BATCH
        directions, check_length, repeats = 8, 12, 50
    if args.steps is None:
        args.steps = TINY["steps"] if args.tiny else DEFAULT_STEPS[args.cell]

    start = time.perf_counter()
    k_model, k_check, k_train, k_eval, k_time = jr.split(jr.key(args.seed), 5)
    model = Model(args.cell, hidden, key=k_model)
    n_params = sum(a.size for a in jtu.tree_leaves(eqx.filter(model, eqx.is_array)))
    print(
        f"Adding problem: T={length} (lengths {length // 2}..{length}, padded and "
        f"masked), {args.cell} cell, hidden {hidden}, {n_params} parameters"
    )
    print()
    gradient_check(model, k_check, directions, check_length)
    print()

    eval_batch = make_batch(k_eval, 1000, length)
    evaluate = eqx.filter_jit(loss_fn)
    baseline = float(jnp.mean((1.0 - eval_batch[2]) ** 2))
    initial = float(evaluate(model, *eval_batch))
    model, losses = train(model, args.steps, k_train, batch, length)
    final = float(evaluate(model, *eval_batch))
    print(
        f"Training: {args.steps} Adam steps, batch {batch}, lr {LEARNING_RATE:g}, "
        f"gradient norm clipped to {CLIP_NORM:g}"
    )
    print(f"  baseline MSE (predict 1.0)   {baseline:.4f}")
    print(f"  initial MSE                  {initial:.4f}")
    ratio = baseline / final
    print(f"  final MSE                    {final:.4f}   ({ratio:.0f}x below baseline)")
    if args.plot:
        plot(losses, args.plot)
        print(f"  loss curve written to {args.plot}")
    print()
    time_forward(model, k_time, repeats, batch, length)
    print()
    print(f"Total time {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    main()
