"""Flax linen `nn.scan` parameters beyond `Dense`, through a name map: LayerNorm,
RMSNorm, Embed, Conv, DenseGeneral, in a nested module; checked against Flax's own
forward pass."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan
from eqxscan.checkpoint import NameMap, Reshape, Rule, Transpose


nn = pytest.importorskip("flax.linen")
S, D, F, H, E = 6, 4, 5, 2, 3  # sequence, width, hidden, heads, head size


class FlaxSub(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.DenseGeneral((H, E))(nn.RMSNorm()(h))


class FlaxBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        x = x + nn.Embed(S, D)(jnp.arange(x.shape[0]))  # learned positions
        h = nn.Conv(D, (3,), padding="SAME")(nn.LayerNorm()(x))
        h = FlaxSub()(nn.relu(nn.Dense(F)(h)))
        return x + nn.Dense(D)(h.reshape(h.shape[0], -1)), None


class Sub(eqx.Module):
    norm: eqx.nn.RMSNorm
    proj: eqx.nn.Linear

    def __init__(self, key):
        self.norm = eqx.nn.RMSNorm(F, eps=1e-6, use_bias=False)
        self.proj = eqx.nn.Linear(F, H * E, key=key)


class Block(eqx.Module):
    pos: eqx.nn.Embedding
    norm: eqx.nn.LayerNorm
    conv: eqx.nn.Conv1d
    up: eqx.nn.Linear
    sub: Sub
    down: eqx.nn.Linear

    def __init__(self, *, key):
        k = jax.random.split(key, 5)
        self.pos = eqx.nn.Embedding(S, D, key=k[4])
        self.norm = eqx.nn.LayerNorm(D, eps=1e-6)
        self.conv = eqx.nn.Conv1d(D, D, 3, padding=1, key=k[0])
        self.up = eqx.nn.Linear(D, F, key=k[1])
        self.sub = Sub(k[2])
        self.down = eqx.nn.Linear(H * E, D, key=k[3])

    def __call__(self, x):  # [S, D], channels last as in Flax
        x = x + jax.vmap(self.pos)(jnp.arange(x.shape[0]))
        h = self.conv(jax.vmap(self.norm)(x).T).T
        h = jax.nn.relu(jax.vmap(self.up)(h))
        h = jax.vmap(self.sub.proj)(jax.vmap(self.sub.norm)(h))
        return x + jax.vmap(self.down)(h)


NAMES = NameMap(
    {
        "{i}.pos.weight": "{i}.Embed_0.embedding",  # both [vocab, D]
        "{i}.norm.weight": "{i}.LayerNorm_0.scale",
        "{i}.norm.bias": "{i}.LayerNorm_0.bias",
        # eqx: [out, in, width], Flax: [width, in, out]; eqx's bias is [out, 1].
        "{i}.conv.weight": Rule("{i}.Conv_0.kernel", Transpose((2, 1, 0))),
        "{i}.conv.bias": Rule("{i}.Conv_0.bias", Reshape((D,))),
        "{i}.up.weight": Rule("{i}.Dense_0.kernel", Transpose()),
        "{i}.up.bias": "{i}.Dense_0.bias",
        "{i}.sub.norm.weight": "{i}.FlaxSub_0.RMSNorm_0.scale",
        # DenseGeneral keeps the heads: kernel [F, H, E], bias [H, E].
        "{i}.sub.proj.weight": Rule(
            "{i}.FlaxSub_0.DenseGeneral_0.kernel", Transpose(), Reshape((F, H, E))
        ),
        "{i}.sub.proj.bias": Rule("{i}.FlaxSub_0.DenseGeneral_0.bias", Reshape((H, E))),
        "{i}.down.weight": Rule("{i}.Dense_1.kernel", Transpose()),
        "{i}.down.bias": "{i}.Dense_1.bias",
    },
    format="flax",
)


def test_nested_norms_conv_and_dense_general_match_flax():
    scanned = nn.scan(
        FlaxBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3
    )()
    x = jax.random.normal(jax.random.key(1), (S, D))
    # Flax's parameter tree, drawn here (no initialisers run): norm scales and
    # biases away from their initial ones and zeros.
    rng = np.random.default_rng(0)

    def draw(path, a):
        mean = 1.0 if path[-1].key == "scale" else 0.0
        return rng.normal(mean, 0.3, a.shape).astype(np.float32)

    shapes = jax.eval_shape(scanned.init, jax.random.key(0), x, None)
    variables = jax.tree_util.tree_map_with_path(draw, shapes)
    like = eqx.filter_eval_shape(
        lambda: eqxscan.Stacked(lambda k: Block(key=k), 3, key=jax.random.key(2))
    )
    stack = eqxscan.from_flax_scan(like, variables, names=NAMES)
    with jax.numpy_rank_promotion("allow"):  # as Flax's modules need
        expected = scanned.apply(variables, x, None)[0]
    np.testing.assert_allclose(stack(x), expected, rtol=1e-5, atol=1e-5)
    # And back: Flax's tree from eqxscan's weights.
    state = NAMES.export(stack)
    flat = eqxscan.checkpoint.flax_scan_state(variables)
    assert state.keys() == flat.keys()
    for name in state:
        np.testing.assert_array_equal(state[name], flat[name], err_msg=name)


def test_flax_parameters_of_another_shape_are_named():
    like = eqx.filter_eval_shape(
        lambda: eqxscan.Stacked(lambda k: Block(key=k), 2, key=jax.random.key(2))
    )
    stacked = {
        "LayerNorm_0": {"scale": np.ones((2, D + 1), np.float32)},
    }
    with pytest.raises(ValueError) as e:
        eqxscan.from_flax_scan(like, stacked, names=NAMES)
    msg = str(e.value)
    assert "'0.LayerNorm_0.scale' (layer 0) is float32[5], '0.norm.weight' needs" in msg
    assert "missing '0.Conv_0.kernel' (layer 0)" in msg
    with pytest.raises(ValueError, match="one leading layer axis"):
        eqxscan.checkpoint.flax_scan_state(
            {"a": {"kernel": np.ones((2, 3))}, "b": {"scale": np.ones((3,))}}
        )
