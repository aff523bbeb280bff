"""Stateful layers (`eqx.nn.State`, `StateIndex`, `BatchNorm`) in Recurrent,
Stacked and Chain, against hand-written references."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import eqxscan


MODES = ["scan", "loop"]


class Counted(eqx.Module):
    """A GRU cell that also counts its steps in an `eqx.nn.State`."""

    cell: eqx.nn.GRUCell
    n: eqx.nn.StateIndex

    def __init__(self, key):
        self.cell = eqx.nn.GRUCell(3, 4, key=key)
        self.n = eqx.nn.StateIndex(jnp.array(0))

    def __call__(self, x, carry):
        h, s = carry
        return self.cell(x, h), s.set(self.n, s.get(self.n) + 1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("masked", [False, True])
def test_state_in_recurrent_carry(getkey, mode, masked):
    cell, state = eqx.nn.make_with_state(Counted)(getkey())
    xs = jr.normal(getkey(), (5, 3))
    mask = jnp.array([True, True, False, True, False]) if masked else None
    rnn = eqxscan.Recurrent(cell, mode=mode)
    (h, s), hs = rnn((jnp.zeros(4), state), xs, mask=mask)

    # The reference: a hand-written lax.scan over the same cell.
    def step(carry, inputs):
        x, m = inputs
        old = jax.tree.unflatten(*reversed(jax.tree.flatten(carry)))  # a clone
        new = cell(x, carry)
        new = jax.tree.map(lambda a, b: jnp.where(m, a, b), new, old)
        return new, new[0]

    _, ref_state = eqx.nn.make_with_state(Counted)(jr.key(0))
    m = jnp.ones(5, bool) if mask is None else mask
    (h_ref, s_ref), hs_ref = jax.lax.scan(step, (jnp.zeros(4), ref_state), (xs, m))
    assert int(s.get(cell.n)) == int(m.sum())
    assert int(s.get(cell.n)) == int(s_ref.get(cell.n))
    np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hs[0], hs_ref, rtol=1e-5, atol=1e-6)


class Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.norm = eqx.nn.BatchNorm(3, "batch", momentum=0.5, mode="ema")

    def __call__(self, x, state):
        x, state = self.norm(self.linear(x), state)
        return jnp.tanh(x), state


def _batched(model):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))


def _reference(key, num_layers, xs_list, inference=False):
    """A Python loop over the layers, each built and stateful on its own."""
    layers, states = zip(
        *(eqx.nn.make_with_state(Block)(k) for k in jr.split(key, num_layers))
    )
    layers, states = list(layers), list(states)
    if inference:
        layers = [eqx.nn.inference_mode(layer) for layer in layers]
    outs = []
    for xs in xs_list:
        y = xs
        for i, layer in enumerate(layers):
            y, states[i] = _batched(layer)(y, states[i])
        outs.append(y)
    return outs, layers, states


def _running_stats(state, index):
    return state.get(index)


@pytest.mark.parametrize("mode", MODES)
def test_stateful_stacked_like_equinox(getkey, mode):
    key, n = getkey(), 3
    model, state = eqx.nn.make_with_state(eqxscan.Stacked)(Block, n, key=key, mode=mode)
    batches = [jr.normal(getkey(), (8, 3)) for _ in range(2)]
    outs = []
    for xs in batches:  # two steps: the second reads the first's statistics
        y, state = _batched(model)(xs, state)
        outs.append(y)
    ref_outs, ref_layers, ref_states = _reference(key, n, batches)
    for y, r in zip(outs, ref_outs):
        np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-6)
    mean, var = state.get(model.layers.norm.ema_state_index)
    assert mean.shape == (n, 3)
    for i in range(n):
        ref_mean, ref_var = ref_states[i].get(ref_layers[i].norm.ema_state_index)
        np.testing.assert_allclose(mean[i], ref_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var[i], ref_var, rtol=1e-5, atol=1e-6)

    # Inference mode: running statistics are used and the state is unchanged.
    inference = eqx.nn.inference_mode(model)
    xs = jr.normal(getkey(), (4, 3))
    y, state2 = _batched(inference)(xs, state)
    ref_layers = [eqx.nn.inference_mode(layer) for layer in ref_layers]
    r = xs
    for layer, s in zip(ref_layers, ref_states):
        r, _ = _batched(layer)(r, s)
    np.testing.assert_allclose(y, r, rtol=1e-5, atol=1e-6)
    mean2, _ = state2.get(model.layers.norm.ema_state_index)
    np.testing.assert_array_equal(mean2, mean)


def test_stacked_vmap_refuses_a_state(getkey):
    # Every layer would be handed the whole stacked state (each entry `[L, ...]`)
    # as if it were its own.
    model, state = eqx.nn.make_with_state(eqxscan.Stacked)(Block, 2, key=getkey())
    with pytest.raises(TypeError, match="Stacked.vmap does not take an eqx.nn.State"):
        jax.vmap(model.vmap, axis_name="batch", in_axes=(0, None))(
            jnp.ones((4, 3)), state
        )


def test_one_layer_or_a_slice_of_a_stateful_stack(getkey):
    key, n = getkey(), 3
    model, state = eqx.nn.make_with_state(eqxscan.Stacked)(Block, n, key=key)
    xs = jr.normal(getkey(), (8, 3))
    _, ref_layers, ref_states = _reference(key, n, [])
    sub = state.substate(model.layers)
    # Layer 1 with its slice of the state (docs/idioms.md), as built alone.
    y, new = _batched(model[1])(xs, jax.tree.map(lambda a: a[1], sub))
    ref_y, ref_new = _batched(ref_layers[1])(xs, ref_states[1])
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
    index, ref_index = (
        model.layers.norm.ema_state_index,
        ref_layers[1].norm.ema_state_index,
    )
    assert index is not None and ref_index is not None
    np.testing.assert_allclose(new.get(index)[0], ref_new.get(ref_index)[0])
    # A slice given the whole stack's state names the entry and the way out.
    with pytest.raises(ValueError) as e:
        _batched(model[1:3])(xs, state)
    first, hint = str(e.value).splitlines()
    assert "has 2 layers, but its state entry `Stacked.layers.norm." in first
    assert "takes the matching slice of its state" in hint
    y, _ = _batched(model[1:3])(xs, jax.tree.map(lambda a: a[1:3], sub))
    ref_y, _ = _batched(ref_layers[2])(ref_y, ref_states[2])
    np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_stateful_layers_built_one_by_one_stack(getkey, mode):
    key, n = getkey(), 3
    keys = jr.split(key, n)
    # Each raw layer has its own StateIndex markers; they still stack.
    model, state = eqx.nn.make_with_state(eqxscan.Stacked.from_layers)(
        [Block(k) for k in keys], mode=mode
    )
    same, _ = eqx.nn.make_with_state(eqxscan.Stacked)(Block, n, key=key)
    assert eqx.tree_equal(model.layers, same.layers)
    xs = jr.normal(getkey(), (8, 3))
    y, state = _batched(model)(xs, state)
    (ref,), _, _ = _reference(key, n, [xs])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_stateful_chain(getkey, mode):
    key = getkey()
    keys = jr.split(key, 3)
    proj = eqx.nn.Linear(3, 3, key=getkey())

    class Proj(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x, state):
            return self.linear(x), state

    layers = [Proj(proj), *(Block(k) for k in keys)]
    chain, state = eqx.nn.make_with_state(eqxscan.Chain)(layers, mode=mode)
    # The three Blocks are scanned as one group, not left as lone layers.
    assert [span.size for span in chain.layout] == [1, 3]
    xs = jr.normal(getkey(), (8, 3))
    y, state = _batched(chain)(xs, state)
    (ref,), ref_layers, ref_states = _reference(key, 3, [jax.vmap(proj)(xs)])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    mean, _ = state.get(chain.groups[1].layers.norm.ema_state_index)
    ref_mean, _ = ref_states[2].get(ref_layers[2].norm.ema_state_index)
    np.testing.assert_allclose(mean[2], ref_mean, rtol=1e-5, atol=1e-6)
    # `scan` carries only x: a state given as its first extra argument is refused
    # by name, not taken for something else.
    with pytest.raises(TypeError, match="Chain.scan does not take an eqx.nn.State"):
        chain.scan(xs[0], state)


def test_a_reversed_slice_of_stateful_layers_is_refused(getkey):
    # Its layers reversed but not its state, each layer would read another's
    # running statistics; `reverse=True` runs them backwards with their own.
    key, n = getkey(), 2
    model, state = eqx.nn.make_with_state(eqxscan.Stacked)(Block, n, key=key)
    xs = jr.normal(getkey(), (8, 3))
    _, state = _batched(model)(xs, state)
    _, ref_layers, ref_states = _reference(key, n, [xs])
    inference = eqx.nn.inference_mode(model)
    for sliced in [lambda: inference[::-1], lambda: inference[n - 1 :: -1]]:
        with pytest.raises(ValueError, match=r"reverses them.*\n.*reverse=True"):
            sliced()
    y, _ = _batched(lambda x, s: inference(x, s, reverse=True))(xs, state)
    ref = xs
    for layer, s in zip(ref_layers[::-1], ref_states[::-1]):
        ref, _ = _batched(eqx.nn.inference_mode(layer))(ref, s)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    # Forward slices, and a reversed chain of stateful layers alone, stay.
    assert len(inference[::1]) == n
    chain, _ = eqx.nn.make_with_state(eqxscan.Chain)(
        [Block(k) for k in jr.split(key, n)]
    )
    with pytest.raises(ValueError, match="Cannot take .* of a Chain of stateful"):
        chain[::-1]
    lone = eqxscan.Chain([chain[0], eqx.nn.Identity()])
    assert len(lone[::-1]) == 2


def test_a_slice_that_regroups_stateful_layers_is_refused(getkey):
    # The slice's groups are new, its layers' StateIndexes the whole chain's: no
    # eqx.nn.State fits it (the whole chain's would meet a layer axis of 4).
    key = getkey()
    chain, state = eqx.nn.make_with_state(eqxscan.Chain)(
        [Block(k) for k in jr.split(key, 4)]
    )
    for index in (slice(0, 2), slice(1, None), slice(None, None, 2)):
        with pytest.raises(ValueError, match=r"groups its layers afresh"):
            chain[index]
    # The whole chain, in order, keeps its groups and its state.
    xs = jr.normal(getkey(), (8, 3))
    y, _ = _batched(chain[:])(xs, state)
    np.testing.assert_allclose(y, _batched(chain)(xs, state)[0], rtol=1e-6)


def test_with_layer_keeps_the_state_of_a_stateful_stack(getkey):
    # A layer made afresh has state indexes of its own, whose state the model's
    # eqx.nn.State does not hold: named as such, with the way that works.
    model, _ = eqx.nn.make_with_state(eqxscan.Stacked)(Block, 2, key=getkey())
    with pytest.raises(ValueError, match=r"StateIndex at `.norm.* is not the stack's"):
        model.with_layer(1, Block(getkey()))
    linear = eqx.nn.Linear(3, 3, key=getkey())
    new = model.with_layer(1, eqx.tree_at(lambda b: b.linear, model[1], linear))
    np.testing.assert_array_equal(new.layers.linear.weight[1], linear.weight)
    index = lambda m: m[1].norm.ema_state_index.marker  # noqa: E731
    assert index(new) == index(model)
