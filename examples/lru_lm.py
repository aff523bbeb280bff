"""Train a small character-level language model built on a linear recurrence
(`eqxscan.LRU` or `eqxscan.MinGRU`), run in parallel over time for training and
one step at a time for generation.

    python examples/lru_lm.py                 # LRU, 300 steps, about a minute on CPU
    python examples/lru_lm.py --cell mingru --method chunked
    python examples/lru_lm.py --tiny          # every step at the smallest sizes

`--tiny` (what the tests run) trains 40 steps of a 1-layer, 32-wide model on
sequences of 32 characters.

What it shows:

1. `eqxscan.Recurrent(cell, method=...)` runs the recurrence sequentially,
   associatively or in chunks: the same values (checked here), different speed.
2. Each layer is the LRU recipe: norm, the recurrence, a read-out of the
   (complex) state, a gated MLP, residual connections.
3. Generation calls the cell itself, one step at a time, with the carries of
   the prompt from the parallel form; its logits equal the parallel form's.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax

import eqxscan


TEXT = (
    "the quick brown fox jumps over the lazy dog. a linear recurrence keeps a "
    "state that decays and is refreshed by each input; its steps compose, so the "
    "whole sequence can be scanned in parallel, and one step at a time when "
    "generating text. the lazy dog sleeps while the quick fox runs on and on. "
) * 4
CHARS = sorted(set(TEXT))
TINY = dict(steps=40, layers=1, width=32, length=32, batch=8)  # --tiny


def norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)


class Layer(eqx.Module):
    rnn: eqxscan.Recurrent
    read: eqx.nn.Linear
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, cell_name, width, method, *, key):
        k1, k2, k3, k4 = jr.split(key, 4)
        if cell_name == "lru":
            cell = eqxscan.LRU(width, width, r_min=0.5, r_max=0.99, key=k1)
            read_in = 2 * width  # real and imaginary parts
        else:
            cell = eqxscan.MinGRU(width, width, key=k1)
            read_in = width
        self.rnn = eqxscan.Recurrent(cell, method=method, chunk_size=16)
        self.read = eqx.nn.Linear(read_in, width, key=k2)
        self.up = eqx.nn.Linear(width, 4 * width, key=k3)
        self.down = eqx.nn.Linear(2 * width, width, key=k4)

    def features(self, hs):
        if jnp.iscomplexobj(hs):
            return jnp.concatenate([hs.real, hs.imag], axis=-1)
        return hs

    def mix(self, x, hs):
        """Everything after the recurrence, for one step or all of them."""
        x = x + jax.vmap(self.read)(self.features(hs))
        a, b = jnp.split(jax.vmap(self.up)(norm(x)), 2, axis=-1)
        return x + jax.vmap(self.down)(jax.nn.gelu(a) * b)

    def h0(self):
        cell = self.rnn.cell
        dtype = (
            jnp.complex64
            if isinstance(cell, eqxscan.LRU) and not cell.real
            else jnp.float32
        )
        return jnp.zeros(cell.hidden_size, dtype)

    def __call__(self, x):
        """`[T, width] -> ([T, width], every step's carry)`."""
        _, hs = self.rnn(self.h0(), norm(x))
        return self.mix(x, hs), hs


class LM(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list
    out: eqx.nn.Linear

    def __init__(self, cell_name, layers, width, method, *, key):
        keys = jr.split(key, layers + 2)
        self.embed = eqx.nn.Embedding(len(CHARS), width, key=keys[0])
        self.layers = [Layer(cell_name, width, method, key=k) for k in keys[2:]]
        self.out = eqx.nn.Linear(width, len(CHARS), key=keys[1])

    def __call__(self, tokens):
        """Logits for every position of `tokens` `[T]`, and each layer's carries."""
        x, carries = jax.vmap(self.embed)(tokens), []
        for layer in self.layers:
            x, hs = layer(x)
            carries.append(hs)
        return jax.vmap(self.out)(norm(x)), carries

    def step(self, token, hs):
        """One token with the layers' carries `hs`: the recurrent form."""
        x, new = self.embed(token)[None], []
        for layer, h in zip(self.layers, hs):
            h = layer.rnn.cell(norm(x)[0], h)
            x = layer.mix(x, h[None])
            new.append(h)
        return self.out(norm(x)[0]), new


def encode(text):
    return jnp.array([CHARS.index(c) for c in text])


def batches(key, data, length, batch):
    starts = jr.randint(key, (batch,), 0, len(data) - length - 1)
    idx = starts[:, None] + jnp.arange(length + 1)
    return data[idx[:, :-1]], data[idx[:, 1:]]


def loss_fn(model, x, y):
    logits = jax.vmap(lambda t: model(t)[0])(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cell", choices=["lru", "mingru"], default="lru")
    p.add_argument("--method", default="auto")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="the smallest sizes")
    args = p.parse_args()
    if args.tiny:
        vars(args).update(TINY)
    key = jr.key(0)
    model = LM(args.cell, args.layers, args.width, args.method, key=key)
    data = encode(TEXT)

    # 1. The forms agree.
    x, y = batches(jr.key(1), data, args.length, 2)
    logits = {
        m: jax.jit(lambda model, m=m: jax.vmap(lambda t: model(t)[0])(x))(
            eqx.tree_at(
                lambda mod: [layer.rnn for layer in mod.layers],
                model,
                [layer.rnn.with_options(method=m) for layer in model.layers],
            )
        )
        for m in ("sequential", "associative", "chunked")
    }
    diff = max(
        float(jnp.max(jnp.abs(v - logits["sequential"]))) for v in logits.values()
    )
    print(f"forms agree: max |logit diff| {diff:.1e}")

    # 2. Training.
    opt = optax.adam(3e-3)
    state = opt.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def train_step(model, state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, state = opt.update(grads, state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), state, loss

    keys = jr.split(jr.key(2), args.steps)
    first = None
    for i, k in enumerate(keys):
        model, state, loss = train_step(
            model, state, *batches(k, data, args.length, args.batch)
        )
        first = float(loss) if first is None else first
        if i % max(1, args.steps // 5) == 0 or i == args.steps - 1:
            print(f"step {i:4d} loss {float(loss):.3f}")
    print(f"loss: first {first:.3f} final {float(loss):.3f}")

    # 3. Generation, one step at a time from the prompt's carries.
    prompt = encode("the quick ")
    logits, carries = eqx.filter_jit(model)(prompt)
    hs = [c[-1] for c in carries]
    step = eqx.filter_jit(model.step)
    out, stepped, token = [], [], int(jnp.argmax(logits[-1]))
    for _ in range(30):
        out.append(CHARS[token])
        logit, hs = step(jnp.array(token), hs)
        stepped.append(logit)
        token = int(jnp.argmax(logit))
    # The parallel form over prompt and generated text, once: position P + i
    # reads what step i read.
    full, _ = eqx.filter_jit(model)(jnp.concatenate([prompt, encode("".join(out))]))
    gap = float(jnp.max(jnp.abs(jnp.stack(stepped) - full[len(prompt) :])))
    print(f"generated: 'the quick {''.join(out)}'")
    print(f"one step at a time = parallel form: max |logit diff| {gap:.1e}")


if __name__ == "__main__":
    main()
