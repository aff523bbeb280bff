"""`python -m benchmarks.bench.meshes`: the meshes of a decoder's training run on `N`
devices.

Prints the table of [`eqxscan.planning.plan`][] (every mesh and remat setting,
compiled ahead of time, nothing allocated) for a pre-norm decoder: token
embedding, `L` blocks of the benchmark Transformer (`benchmarks.bench`'s `Block`:
causal attention, GELU MLP of width `4D`) in one `eqxscan.Stacked`, a final
LayerNorm and an untied output projection; parameters in bfloat16 by default,
Adam's moments in float32.

    python -m benchmarks.bench.meshes --devices 64 --layers 32 --dim 4096 --seq 2048 \\
        --batch 64 --vocab 32000 --budget 80GB --model-axis 1 8
"""

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree

from eqxscan import Remat, Stacked
from eqxscan.planning import plan

from ._transformer import Block, EPS


#: Logical names of one block's axes (`[out, in]` weights), for a model axis:
#: attention heads and the MLP's hidden units split over `"model"`.
AXES: dict[str, tuple[str | None, ...]] = {
    "blocks.layers.attn.query_proj.weight": ("heads", "embed"),
    "blocks.layers.attn.key_proj.weight": ("heads", "embed"),
    "blocks.layers.attn.value_proj.weight": ("heads", "embed"),
    "blocks.layers.attn.output_proj.weight": ("embed", "heads"),
    "blocks.layers.mlp_in.weight": ("mlp", "embed"),
    "blocks.layers.mlp_in.bias": ("mlp",),
    "blocks.layers.mlp_out.weight": ("embed", "mlp"),
}
RULES: dict[str, str | None] = {"heads": "model", "mlp": "model", "embed": "fsdp"}
LEARNING_RATE = 1e-3
#: `--remat`'s words.
REMAT_WORDS: dict[str, Remat] = {
    "False": False,
    "True": True,
    "auto": "auto",
    "nested": "nested",
    "offload": "offload",
}


class Decoder(eqx.Module):
    """A pre-norm decoder over token ids `[B, T]`, returning logits `[B, T, V]`."""

    embed: Array
    blocks: Stacked
    norm: eqx.nn.LayerNorm
    unembed: Array

    def __init__(
        self,
        *,
        layers: int,
        dim: int,
        vocab: int,
        key: PRNGKeyArray,
        dtype: str = "bfloat16",
    ):
        dt = jnp.dtype(dtype)
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = (jax.random.normal(k1, (vocab, dim)) * 0.02).astype(dt)
        self.blocks = Stacked(lambda k: Block(dim, key=k, dtype=dt), layers, key=k2)
        self.norm = eqx.nn.LayerNorm(dim, eps=EPS, dtype=dt)
        self.unembed = (jax.random.normal(k3, (vocab, dim)) * dim**-0.5).astype(dt)

    def __call__(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T V"]:
        x = self.blocks(self.embed[tokens])
        x = jax.vmap(jax.vmap(self.norm))(x)
        return jnp.einsum("btd,vd->btv", x, self.unembed)


def decoder(
    key: PRNGKeyArray, *, layers: int, dim: int, vocab: int, dtype: str = "bfloat16"
) -> Decoder:
    """`Decoder(...)`: the model builder [`eqxscan.planning.plan`][] calls."""
    return Decoder(layers=layers, dim=dim, vocab=vocab, key=key, dtype=dtype)


class AdamState(NamedTuple):
    step: Array
    mu: PyTree[Array]
    nu: PyTree[Array]


def adam(
    learning_rate: float = LEARNING_RATE,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> optax.GradientTransformation:
    """Adam with float32 moments whatever the parameters' dtype; each update is
    cast back to its parameter's dtype. (Written out rather than wrapping
    `optax.adam`, whose bias correction needs standard dtype promotion.)"""

    def init(params: optax.Params) -> AdamState:
        zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
        return AdamState(
            jnp.zeros((), jnp.int32),
            jax.tree.map(zeros, params),
            jax.tree.map(zeros, params),
        )

    def update(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, AdamState]:
        assert isinstance(state, AdamState)
        grads = updates
        count = state.step + 1
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, g32)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, g32)
        t = count.astype(jnp.float32)
        c1, c2 = 1 - jnp.float32(b1) ** t, 1 - jnp.float32(b2) ** t

        def step(m: Array, v: Array, g: Array) -> Array:
            u = -learning_rate * (m / c1) / (jnp.sqrt(v / c2) + eps)
            return u.astype(g.dtype)

        return jax.tree.map(step, mu, nu, grads), AdamState(count, mu, nu)

    return optax.GradientTransformation(init, update)


def loss_fn(model: Decoder, tokens: Array, targets: Array) -> Array:
    logits = model(tokens).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(
    model: Decoder, opt_state: optax.OptState, batch: tuple[Array, Array]
) -> tuple[Decoder, optax.OptState, Array]:
    """One Adam step on next-token cross-entropy; `batch` is `(tokens, targets)`."""
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *batch)
    updates, opt_state = adam().update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss


def analytic_state_bytes(
    layers: int,
    dim: int,
    vocab: int,
    param_bytes: int = 2,
    *,
    fsdp: int = 1,
    model: int = 1,
) -> float:
    """Parameter + Adam bytes on one device (`param_bytes` per parameter plus 8
    for the two float32 moments) under `AXES` and `RULES`: per block the
    projections and MLP matrices (`12 D^2`) split over `fsdp x model`, the MLP's
    first bias (`4 D`) over `model`, its other vectors (`5 D`) over `fsdp`; the
    embedding and output projection (`2 V D`) over `fsdp`. (Small leaves that
    `min_size` replicates, e.g. the final LayerNorm, are counted split.)"""
    per_block = 12 * dim * dim / (fsdp * model) + 4 * dim / model + 5 * dim / fsdp
    count = layers * per_block + (2 * vocab * dim + 2 * dim) / fsdp
    return count * (param_bytes + 8)


def batch_shape(batch: int, seq: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return (tokens, tokens)


def _bar(done: int, total: int, what: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:40]:<40}"
    )
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _mesh(text: str) -> tuple[int, int, int]:
    """`data,fsdp,model`, e.g. `8,8,1`."""
    data, fsdp, model = (int(s) for s in text.split(","))
    return data, fsdp, model


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench.meshes", description=__doc__
    )
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=None, help="global (default: N)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--budget", default="80GB")
    p.add_argument("--model-axis", type=int, nargs="+", default=[1])
    p.add_argument(
        "--meshes",
        nargs="+",
        default=None,
        help="data,fsdp,model triples, e.g. 8,8,1 1,64,1 (default: all)",
    )
    p.add_argument(
        "--remat",
        nargs="+",
        choices=list(REMAT_WORDS),
        default=["False", "True"],
        help="remat settings to compare (default: False True)",
    )
    p.add_argument("--accelerator", default="H100")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    remat: list[Remat] = [REMAT_WORDS[r] for r in args.remat]
    meshes = None if args.meshes is None else [_mesh(m) for m in args.meshes]
    start = time.perf_counter()
    # By reference, for the fresh processes `plan` starts when devices are missing.
    here = __spec__.name if __spec__ is not None else __name__
    result = plan(
        f"{here}:decoder",
        f"{here}:train_step",
        optimizer=f"{here}:adam",
        batch=batch_shape(args.batch or args.devices, args.seq),
        budget=args.budget,
        devices=None if meshes else args.devices,
        meshes=meshes,
        model_axis=args.model_axis,
        remat=remat,
        axes=AXES if max(args.model_axis) > 1 or meshes else None,
        rules=RULES,
        model_kwargs=dict(
            layers=args.layers, dim=args.dim, vocab=args.vocab, dtype=args.dtype
        ),
        accelerator=args.accelerator,
        progress=_bar,
    )
    seconds = time.perf_counter() - start
    param_bytes = jnp.dtype(args.dtype).itemsize
    analytic = {
        c.mesh: analytic_state_bytes(
            args.layers,
            args.dim,
            args.vocab,
            param_bytes,
            fsdp=c.mesh[1],
            model=c.mesh[2],
        )
        for c in result.candidates
    }
    print(result)
    print("\n| data | fsdp | model | params+opt GiB (plan) | analytic GiB | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in result.candidates:
        if c.error is None and c.remat == result.candidates[0].remat:
            a = analytic[c.mesh]
            print(
                f"| {c.mesh[0]} | {c.mesh[1]} | {c.mesh[2]} | "
                f"{c.state_bytes / 2**30:.3f} | {a / 2**30:.3f} | "
                f"{c.state_bytes / a:.3f} |"
            )
    print(f"\nplan took {seconds:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "seconds": seconds,
                    "analytic_state_bytes": [[list(m), a] for m, a in analytic.items()],
                    "chosen": None
                    if result.chosen is None
                    else result.chosen.to_json(),
                    "rows": [c.to_json() for c in result.candidates],
                    "markdown": result.markdown(),
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
