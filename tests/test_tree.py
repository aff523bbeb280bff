"""The model walker of `eqxscan._containers.walk`: key paths, layer depths and
state-dict names."""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxscan
from eqxscan._containers.stacked import LayerNumbering
from eqxscan._containers.walk import for_each, Site, walk


class Block(eqx.Module):
    inner: eqxscan.Stacked
    scale: jnp.ndarray

    def __init__(self, key):
        self.inner = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=key)
        self.scale = jnp.ones(4)


class Model(eqx.Module):
    blocks: eqxscan.Stacked
    head: eqx.nn.Linear
    extra: tuple
    rate: float = 0.5


def _model(key):
    k1, k2 = jr.split(key)
    blocks = eqxscan.Stacked(Block, 2, key=k1)
    return Model(blocks, eqx.nn.Linear(4, 2, key=k2), (None, ()))


def test_key_paths_and_depths_match_the_layer_axes(getkey):
    model = _model(getkey())
    seen = []
    for_each(lambda leaf, site: seen.append((site.path, site.depth, leaf)), model)
    # Every leaf, in `tree_leaves` order, with the key path `jax.tree_util` gives.
    expected = jtu.tree_leaves_with_path(model, is_leaf=lambda x: x is None)
    assert [p for p, _, _ in seen] == [p for p, _ in expected]
    by_name = {jtu.keystr(p): (d, leaf) for p, d, leaf in seen}
    # A Stacked inside a Stacked's layer: two leading layer axes.
    depth, weight = by_name[".blocks.layers.inner.layers.weight"]
    assert depth == 2 and weight.shape[:2] == (2, 3)
    assert by_name[".blocks.layers.scale"][0] == 1
    assert by_name[".head.weight"][0] == 0
    assert by_name[".rate"] == (0, 0.5)  # non-array leaves are visited too
    assert by_name[".extra[0]"] == (0, None)


def test_walk_rebuilds_and_keeps_stacked_fields(getkey):
    model = _model(getkey())
    model = eqx.tree_at(
        lambda m: m.blocks, model, model.blocks.with_options(remat=True)
    )
    shapes = walk(
        lambda leaf, site: (site.depth, leaf.shape) if eqx.is_array(leaf) else leaf,
        model,
    )
    assert isinstance(shapes.blocks, eqxscan.Stacked)
    assert shapes.blocks.remat is True and shapes.extra == (None, ())
    assert shapes.blocks.layers.inner.layers.weight == (2, (2, 3, 4, 4))
    assert shapes.head.bias == (0, (2,))


def test_stack_hook_runs_inner_stacks_first(getkey):
    model = _model(getkey())
    order = []

    def hook(stack, site):
        order.append((jtu.keystr(site.path), site.depth, len(stack)))
        return stack

    walk(lambda leaf, site: leaf, model, stack=hook)
    assert order == [(".blocks.layers.inner.layers", 2, 3), (".blocks.layers", 1, 2)]


def test_sites_record_where_each_enclosing_stack_is(getkey):
    model = _model(getkey())
    sites = {}
    for_each(lambda leaf, site: sites.setdefault(jtu.keystr(site.path), site), model)
    site = sites[".blocks.layers.inner.layers.weight"]
    assert site.axes == (2, 3)
    # Path positions of the two `.layers` entries, and the stacks' sizes.
    assert site.enclosing == ((1, 2), (3, 3))
    assert [site.path[i] for i, _ in site.enclosing] == [jtu.GetAttrKey("layers")] * 2


def test_names_walk_numbers_chain_layers_by_index(getkey):
    keys = jr.split(getkey(), 6)
    mlp = lambda k: eqx.nn.MLP(4, 4, 8, 1, key=k)  # noqa: E731
    lin = lambda k: eqx.nn.Linear(4, 4, key=k)  # noqa: E731
    # A lone layer, then 2 repeats of [MLP, Linear, Linear] (a unit with a run).
    layers = [lin(keys[0])] + [
        f(k) for k, f in zip(keys[1:], [mlp, lin, lin, mlp, lin])
    ]
    layers.append(lin(jr.fold_in(keys[0], 1)))
    chain = eqxscan.Chain(layers)
    found = {}

    def record(leaf, site: Site):
        if eqx.is_array(leaf):
            found[site.path] = (site.axes, leaf.shape)

    for_each(record, {"layers": chain}, names=True)
    # Every name, filled in per layer, is that of a list of the layers.
    names = set()
    for parts, (axes, _) in found.items():
        for index in np.ndindex(*axes):
            it = iter(index)
            names.add(
                ".".join(
                    str(p.start + sum(next(it) * s for s in p.strides))
                    if isinstance(p, LayerNumbering)
                    else p
                    for p in parts
                )
            )
    assert names == set(eqxscan.to_state_dict({"layers": layers}))
    for parts, (axes, shape) in found.items():
        assert isinstance(parts[1], LayerNumbering) and shape[: len(axes)] == axes


def test_names_walk_rejects_dotted_dict_keys(getkey):
    with pytest.raises(ValueError, match="no '.'"):
        walk(lambda leaf, site: leaf, {"a.b": jnp.ones(2)}, names=True)
