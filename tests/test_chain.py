import inspect

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest
from hypothesis import given, settings
from jaxtyping import Array

import eqxscan
from eqxscan._containers.chain import Pattern
from eqxscan._containers.chain.grouping import Group, plan
from eqxscan.remat import THRESHOLDS

from .helpers import tree_allclose


SHORT_SCAN = THRESHOLDS.short_scan


D = 4


class Affine(eqx.Module):
    w: Array
    b: Array

    def __init__(self, key, dim=D, out=D):
        self.w = jr.normal(key, (dim, out)) * dim**-0.5
        self.b = jnp.zeros(out)

    def __call__(self, x, shift=None, *, bias=None, key=None):
        x = jnp.tanh(x @ self.w + self.b)
        if shift is not None:
            x = x + shift
        if bias is not None:
            x = x + bias
        if key is not None:
            x = x + 0.1 * jr.normal(key, x.shape)
        return x


class Gate(eqx.Module):
    w: Array

    def __init__(self, key):
        self.w = jr.normal(key, (D, D)) * D**-0.5

    def __call__(self, x, shift=None, *, bias=None, key=None):
        x = x * jax.nn.sigmoid(x @ self.w)
        if shift is not None:
            x = x * shift
        if bias is not None:
            x = x - bias
        if key is not None:
            x = x * jr.uniform(key, x.shape, minval=0.5, maxval=1.5)
        return x


class Scale(eqx.Module):
    """Like `Gate` but a different class: never stacked with it."""

    s: Array

    def __init__(self, key):
        self.s = 1.0 + 0.1 * jr.normal(key, (D,))

    def __call__(self, x, shift=None, *, bias=None, key=None):
        x = x * self.s
        if bias is not None:
            x = x + 2 * bias
        if key is not None:
            x = x + jr.normal(key, x.shape)
        return x


MAKERS = {"A": Affine, "B": Gate, "C": Scale}


def build(pattern, key):
    keys = jr.split(key, len(pattern))
    return [MAKERS[c](k) for c, k in zip(pattern, keys)]


def loop(layers, x, *args, key=None, bias=None, **kwargs):
    keys = None if key is None else jr.split(key, len(layers))
    for i, layer in enumerate(layers):
        extra = dict(kwargs)
        if keys is not None:
            extra["key"] = keys[i]
        if bias is not None:
            extra["bias"] = bias[i]
        x = layer(x, *args, **extra)
    return x


def layout(chain):
    return [(s.start, s.size, s.per_step) for s in chain.layout]


# --- grouping ---------------------------------------------------------------


def test_like_layers_become_stacks(getkey):
    layers = build("AAABCC", getkey())
    chain = eqxscan.Chain(layers)
    assert layout(chain) == [(0, 3, 1), (3, 1, 0), (4, 2, 1)]
    assert isinstance(chain.groups[0], eqxscan.Stacked)
    assert chain.groups[0].layers.w.shape == (3, D, D)
    assert chain.groups[1] is layers[3]
    assert isinstance(chain.groups[2], eqxscan.Stacked)
    assert len(chain) == 6 and chain.num_layers == 6


def test_different_shapes_are_not_stacked(getkey):
    layers = [Affine(getkey()), Affine(getkey(), out=D), Affine(getkey(), dim=D, out=3)]
    chain = eqxscan.Chain(layers)
    assert layout(chain) == [(0, 2, 1), (2, 1, 0)]


def test_alternating_is_one_pattern_scan(getkey):
    layers = build("AB" * 6, getkey())
    chain = eqxscan.Chain(layers)
    assert layout(chain) == [(0, 12, 2)]
    (group,) = chain.groups
    assert isinstance(group, eqxscan.Stacked) and group.num_layers == 6
    assert isinstance(group.layers, Pattern)
    assert group.layers.groups[0].w.shape == (6, D, D)  # Affine, one per repeat


def test_pattern_with_inner_stack(getkey):
    # local, local, global repeated (and a remainder): the pattern's stack is
    # scanned too.
    layers = build("AAB" * 3 + "AA", getkey())
    chain = eqxscan.Chain(layers)
    assert layout(chain) == [(0, 9, 3), (9, 2, 1)]
    pattern = chain.groups[0].layers
    inner = [(s.start, s.size, s.per_step) for s in pattern.layout]
    assert inner == [(0, 2, 1), (2, 1, 0)]
    assert pattern.groups[0].layers.w.shape == (3, 2, D, D)  # [repeats, stack, ...]


def test_prefix_and_suffix_around_pattern(getkey):
    layers = build("C" + "AB" * 3 + "A", getkey())
    assert layout(eqxscan.Chain(layers)) == [(0, 1, 0), (1, 6, 2), (7, 1, 0)]


@pytest.mark.parametrize(
    "pattern, expected",
    [
        ("ABABA", [(0, 4, 2), (4, 1, 0)]),  # tie: the first group takes the most
        ("AABAAB" + "AA", [(0, 6, 3), (6, 2, 1)]),
        ("AAAA", [(0, 4, 1)]),  # a stack beats (AA) x 2
        ("ABC", [(0, 1, 0), (1, 1, 0), (2, 1, 0)]),
        ("AB", [(0, 1, 0), (1, 1, 0)]),  # one repeat is no pattern
        ("ABCABCAB", [(0, 6, 3), (6, 1, 0), (7, 1, 0)]),
    ],
)
def test_grouping_choice(pattern, expected):
    classes = tuple("ABC".index(c) for c in pattern)
    starts, out = 0, []
    for size, per_step, _ in plan(classes, True):
        out.append((starts, size, per_step))
        starts += size
    assert out == expected


def test_patterns_false(getkey):
    chain = eqxscan.Chain(build("ABAB", getkey()), patterns=False)
    assert layout(chain) == [(0, 1, 0), (1, 1, 0), (2, 1, 0), (3, 1, 0)]


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet="ABC", min_size=1, max_size=14))
def test_plan_covers_layers_and_groups_alike(pattern):
    layers = build(pattern, jr.key(0))
    chain = eqxscan.Chain(layers)
    # Groups tile the sequence, in order.
    end = 0
    for place in chain.layout:
        assert place.start == end
        end += place.size
        assert place.per_step in (0, 1) or place.size % place.per_step == 0
    assert end == len(pattern)
    # Round trip is exact: same classes, same arrays.
    back = chain.unstack()
    assert [type(x) for x in back] == [type(x) for x in layers]
    assert bool(eqx.tree_equal(back, layers))
    # Never more bodies than a plain chain of stacks.
    stacks = 1 + sum(a != b for a, b in zip(pattern, pattern[1:]))
    assert _bodies(plan(tuple("ABC".index(c) for c in pattern), True)) <= stacks


def _bodies(groups: tuple[Group, ...]) -> int:
    # Layer bodies a plan traces: one per lone layer or stack, a pattern's own once.
    return sum(_bodies(g.pattern) if g.per_step > 1 else 1 for g in groups)


def test_unstack_round_trip_exact(getkey):
    layers = build("CAABAABAAB" + "C", getkey())
    chain = eqxscan.Chain(layers)
    back = chain.unstack()
    assert len(back) == len(layers)
    for a, b in zip(back, layers):
        assert type(a) is type(b)
        assert eqx.tree_equal(a, b)


# --- equivalence --------------------------------------------------------------


PATTERNS = ["AAABCC", "AB" * 3, "AAB" * 2 + "A", "C" + "AB" * 2 + "C", "ABC"]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_values_keys_and_grads_match_loop(pattern, mode, getkey):
    layers = build(pattern, getkey())
    chain = eqxscan.Chain(layers, mode=mode)
    n = len(layers)
    x = jr.normal(getkey(), (D,))
    shift = 0.1 * jr.normal(getkey(), (D,))
    bias = 0.1 * jr.normal(getkey(), (n, D))
    key = getkey()

    def f_chain(chain, x, shift, bias):
        y = chain(x, shift, bias=eqxscan.per_layer(bias), key=key)
        return jnp.sum(y**2), y

    def f_loop(layers, x, shift, bias):
        y = loop(layers, x, shift, bias=bias, key=key)
        return jnp.sum(y**2), y

    (_, y1), g1 = jax.value_and_grad(f_chain, argnums=(0, 1, 2, 3), has_aux=True)(
        chain, x, shift, bias
    )
    (_, y2), g2 = jax.value_and_grad(f_loop, argnums=(0, 1, 2, 3), has_aux=True)(
        layers, x, shift, bias
    )
    assert tree_allclose(y1, y2)
    assert isinstance(g1[0], eqxscan.Chain)  # gradients have the model's type
    assert tree_allclose(g1[0].unstack(), g2[0], rtol=1e-5, atol=1e-6)
    assert tree_allclose(g1[1:], g2[1:], rtol=1e-5, atol=1e-6)


def test_keys_follow_the_split_rule(getkey):
    # Each layer adds its key's noise: layer i must see split(key, n)[i],
    # whichever group it landed in.
    class Noise(eqx.Module):
        tag: Array

        def __call__(self, x, *, key):
            return x + jr.uniform(key, x.shape) * self.tag

    class Noise2(Noise):
        pass

    layers = [
        (Noise if c == "A" else Noise2)(jnp.full((D,), 10.0**i))
        for i, c in enumerate("AABAABA")
    ]
    chain = eqxscan.Chain(layers)
    assert layout(chain) == [(0, 6, 3), (6, 1, 0)]
    key = getkey()
    keys = jr.split(key, len(layers))
    expected = sum(jr.uniform(k, (D,)) * 10.0**i for i, k in enumerate(keys))
    assert tree_allclose(chain(jnp.zeros(D), key=key), expected, rtol=1e-6)


def test_jit_matches_eager(getkey):
    layers = build("CAABAAB", getkey())
    chain = eqxscan.Chain(layers)
    x = jr.normal(getkey(), (D,))
    key = getkey()
    eager = chain(x, key=key)
    jitted = eqx.filter_jit(lambda c, x, k: c(x, key=k))(chain, x, key)
    assert tree_allclose(eager, jitted)
    assert tree_allclose(eager, loop(layers, x, key=key))


def test_carry_may_change_at_lone_layers(getkey):
    layers = [Affine(getkey(), dim=3, out=D)] + build("ABAB", getkey())
    layers.append(Affine(getkey(), dim=D, out=2))
    chain = eqxscan.Chain(layers)
    assert layout(chain) == [(0, 1, 0), (1, 4, 2), (5, 1, 0)]
    x = jr.normal(getkey(), (3,))
    assert tree_allclose(chain(x), loop(layers, x))


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_collects_every_layer(reverse, getkey):
    class Out(eqx.Module):
        inner: eqx.Module

        def __call__(self, x, *, bias):
            y = self.inner(x, bias=bias)
            return y, y - x

    layers = [Out(layer) for layer in build("CAABAABAA", getkey())]
    chain = eqxscan.Chain(layers)
    assert layout(chain) == [(0, 1, 0), (1, 6, 3), (7, 2, 1)]
    x = jr.normal(getkey(), (D,))
    bias = jr.normal(getkey(), (len(layers), D))
    y, ys = chain.scan(x, bias=eqxscan.per_layer(bias), reverse=reverse)
    ref = {}
    h = x
    # `ys[i]` is layer i's, whichever way the layers ran.
    for i in reversed(range(len(layers))) if reverse else range(len(layers)):
        h, ref[i] = layers[i](h, bias=bias[i])
    assert tree_allclose(y, h)
    assert tree_allclose(ys, jnp.stack([ref[i] for i in range(len(layers))]))


def test_indexing_finds_layers_in_every_group(getkey):
    # A lone layer, then a repeated pattern and a stack that start after it.
    layers = build("CAABAABAA", getkey())
    chain = eqxscan.Chain(layers)
    assert layout(chain) == [(0, 1, 0), (1, 6, 3), (7, 2, 1)]
    for i in range(-len(layers), len(layers)):
        assert tree_allclose(chain[i], layers[i]), i


def test_carry_error_names_the_layer_by_its_index_in_the_chain():
    # The loop knows which step of a stack changed the carry: the error names
    # it by its index in the chain, after the lone layer before the stack.
    class Cut(eqx.Module):
        w: Array

        def __call__(self, x):
            return x * self.w if eqxscan.layer_index() < 3 else x[:1]

    class Lone(eqx.Module):
        def __call__(self, x):
            return x + 1.0

    chain = eqxscan.Chain([Lone()] + [Cut(jnp.ones(2)) for _ in range(3)], mode="loop")
    assert layout(chain) == [(0, 1, 0), (1, 3, 1)]
    with pytest.raises(TypeError, match=r"^Chain layer 3 \(Cut\) changed carry"):
        chain(jnp.ones(2))


def test_with_options_keeps_weights(getkey):
    layers = build("ABAB", getkey())
    chain = eqxscan.Chain(layers, remat=False)
    other = chain.with_options(mode="loop")
    assert other.mode == "loop" and other.remat is False
    assert bool(eqx.tree_equal(other.unstack(), layers))


def _scanned(groups, layout):
    # Every Stacked the chain made, those inside repeated patterns included.
    for group, place in zip(groups, layout):
        if place.per_step > 0:
            yield group
        if place.per_step > 1:
            yield from _scanned(group.layers.groups, group.layers.layout)


def test_with_options_keeps_layer_sharding(getkey):
    # `sharding.shard` sets `layer_sharding` on every scanned group; changing the
    # other options must neither drop it nor regroup the layers.
    layers = build("AABAABCC", getkey())
    mesh = eqxscan.sharding.make_mesh(fsdp=1, devices=jax.devices()[:1])
    chain = eqxscan.sharding.gather_layers(eqxscan.Chain(layers), mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    other = chain.with_options(mode="loop", remat=True, unroll=2)
    assert layout(other) == layout(chain) == [(0, 6, 3), (6, 2, 1)]
    groups = list(_scanned(other.groups, other.layout))
    assert len(groups) == 3  # the repeats, the A stack inside the pattern, the C stack
    for group in groups:
        assert group.layer_sharding == replicated
        assert (group.mode, group.remat, group.unroll) == ("loop", True, 2)
    assert (other.mode, other.remat, other.unroll) == ("loop", True, 2)
    assert bool(eqx.tree_equal(other.unstack(), layers))
    x = jnp.linspace(-1.0, 1.0, D)
    assert tree_allclose(other(x), loop(layers, x))
    with pytest.raises(ValueError, match="mode must be one of"):
        chain.with_options(mode="fast")


# --- program size -------------------------------------------------------------


def _lines(fn, *args):
    return len(eqx.filter_jit(fn).lower(*args).as_text().splitlines())


def test_program_size_flat_in_repeats(getkey):
    x = jnp.ones(D)

    def sizes(repeats):
        layers = build("C" + "AB" * repeats, getkey())
        return (
            _lines(lambda c, x: c(x), eqxscan.Chain(layers), x),
            _lines(loop, layers, x),
        )

    # Groups of more than `SHORT_SCAN` layers: scanned (shorter ones are unrolled).
    chain9, loop9 = sizes(SHORT_SCAN + 1)
    chain16, loop16 = sizes(16)
    assert chain9 == chain16
    assert loop16 > loop9


# --- errors -------------------------------------------------------------------


def test_empty_and_bad_input():
    with pytest.raises(ValueError, match="at least one layer"):
        eqxscan.Chain([])
    with pytest.raises(TypeError, match="layers"):
        eqxscan.Chain(Affine(jr.key(0)))
    with pytest.raises(ValueError, match="mode"):
        eqxscan.Chain([Affine(jr.key(0))], mode="fast")


def test_misfit_names_layers_path_and_shapes(getkey):
    layers = [Affine(getkey()), Affine(getkey(), out=3), Affine(getkey())]
    chain = eqxscan.Chain(layers)
    with pytest.raises(TypeError) as info:
        chain(jnp.ones(D))
    msg = "\n".join(info.value.__notes__)  # one note names the layer and carry
    assert "layer 2 (Affine)" in msg
    assert "`carry` is float32[3]" in msg
    assert "from float32[4] by layer 1 (Affine)" in msg


def test_misfit_in_pytree_carry_names_leaf(getkey):
    class Split(eqx.Module):
        def __call__(self, x):
            return {"h": x["h"].astype(jnp.float16), "c": x["c"]}

    class Use(eqx.Module):
        w: Array

        def __call__(self, x):
            return {"h": x["h"] @ self.w, "c": x["c"]}

    chain = eqxscan.Chain([Split(), Use(jnp.eye(D)), Use(jnp.eye(D))])
    x = {"h": jnp.ones(D), "c": jnp.zeros(2)}
    # The error keeps its own type; its note says how the carry changed.
    with pytest.raises(ValueError) as info:
        eqx.filter_jit(lambda c, x: c(x))(chain, x)
    assert type(info.value).__name__ == "TypePromotionError"
    msg = "\n".join(info.value.__notes__)  # one note names the layer and carry
    assert "layers 1-2 (stack of Use, scanned)" in msg
    assert "`carry['h']` is float16[4], changed from float32[4]" in msg
    assert "by layer 0 (Split)" in msg


def test_eager_call_traces_each_layer_once(getkey):
    calls = []

    class Counting(eqx.Module):
        w: Array

        def __call__(self, x):
            calls.append(1)
            return x @ self.w

    chain = eqxscan.Chain([Counting(jnp.eye(D)), Affine(getkey(), out=3)])
    assert chain(jnp.ones(D)).shape == (3,)
    assert calls == [1]  # no shape-only pre-pass before the real run
    bad = eqxscan.Chain(
        [Counting(jnp.eye(D)), Counting(jnp.ones((D, 3))), Affine(getkey())]
    )
    with pytest.raises(TypeError, match="layer 2"):
        bad(jnp.ones(D))


def test_scanned_group_must_keep_carry(getkey):
    layers = [Affine(getkey(), out=3), Affine(getkey(), out=3)]
    with pytest.raises(TypeError, match="changed carry leaf") as info:
        eqxscan.Chain(layers)(jnp.ones(D))
    notes = info.value.__notes__
    assert any("layers 0-1 (stack of Affine, scanned)" in n for n in notes)


class _FailsAtFour(eqx.Module):
    w: Array

    def __call__(self, x):
        i = eqxscan.layer_index()
        if isinstance(i, int) and i == 4:  # a Python int in loop mode
            raise ValueError("boom")
        return x * self.w


def test_a_loop_error_names_the_layer_by_its_number_in_the_chain(getkey):
    # The note named the layer's place in its stack ("layer 1") where the
    # chain's number (4) and the group's note (layers 3-5) were meant.
    layers = build("AB", getkey()) + [_FailsAtFour(jnp.ones(D)) for _ in range(4)]
    chain = eqxscan.Chain(layers, mode="loop")
    assert tuple(chain.layout[-1])[:2] == (2, 4)
    with pytest.raises(ValueError, match="boom") as info:
        chain(jnp.ones(D))
    notes = info.value.__notes__
    assert any("raised by layer 4 (_FailsAtFour)" in n for n in notes), notes
    assert not any("layer 2 (_FailsAtFour)" in n for n in notes)


def test_per_layer_needs_chain_length(getkey):
    chain = eqxscan.Chain(build("ABAB", getkey()))
    with pytest.raises(ValueError, match=r"per_layer kwargs\['bias'\].*length 4"):
        chain(jnp.ones(D), bias=eqxscan.per_layer(jnp.ones((3, D))))


def test_scan_needs_pairs_and_matching_ys(getkey):
    chain = eqxscan.Chain(build("CAA", getkey()))
    with pytest.raises(TypeError, match=r"layer 0 \(Scale\) returned float32\[4\]"):
        chain.scan(jnp.ones(D))

    class Pair(eqx.Module):
        n: int = eqx.field(static=True)

        def __call__(self, x):
            return x, jnp.zeros(self.n)

    with pytest.raises(TypeError, match=r"float32\[2\].*float32\[3\]"):
        eqxscan.Chain([Pair(2), Pair(2), Pair(3)]).scan(jnp.ones(D))


def test_checkpoint_options_agree(getkey):
    layers = build("CAB" * 3, getkey())
    x = jr.normal(getkey(), (D,))
    key = getkey()

    @eqx.filter_jit
    def value_and_grad(model, x):
        return jax.value_and_grad(lambda m: jnp.sum(m(x, key=key) ** 2))(model)

    base = eqxscan.Chain(layers)
    v1, g1 = value_and_grad(base, x)
    for remat in [False, "nested"]:
        other = base.with_options(remat=remat, unroll=2)
        assert other.groups[0].remat == remat
        v2, g2 = value_and_grad(other, x)
        assert tree_allclose(v1, v2)
        assert tree_allclose(g1.unstack(), g2.unstack(), rtol=1e-5, atol=1e-6)


def test_key_for_lone_layer_without_key_error(getkey):
    class NoKey(eqx.Module):
        w: Array

        def __call__(self, x):
            return x * self.w

    chain = eqxscan.Chain([Affine(getkey()), NoKey(jnp.ones(D)), Affine(getkey())])
    with pytest.raises(TypeError) as info:
        chain(jnp.ones(D), key=getkey())
    msg = str(info.value)
    assert "Chain was called with `key=...`" in msg
    assert "NoKey(x) takes no `key` argument" in msg
    assert chain(jnp.ones(D)).shape == (D,)


@pytest.mark.parametrize("method", ["__call__", "scan"])
def test_reverse_must_be_a_bool(getkey, method):
    # A string would be truthy and run the layers reversed without a word. The
    # test run's runtime type checks would catch it first: call what a user
    # without them runs.
    keys = jr.split(getkey(), 3)
    chain = eqxscan.Chain([eqx.nn.Linear(4, 4, key=k) for k in keys])
    run = inspect.unwrap(getattr(eqxscan.Chain, method))
    with pytest.raises(TypeError, match=r"reverse must be a bool, got str \('False'\)"):
        run(chain, jnp.ones(4), reverse="False")
    with pytest.raises(TypeError, match="patterns"):
        eqxscan.Chain(list(chain), patterns="yes")


class _Scaled(eqx.Module):
    w: Array
    scale: Array

    def __call__(self, x):
        return x + self.scale * jnp.tanh(x @ self.w)


def test_weak_and_strong_scalars_are_not_stacked_together():
    # `jnp.asarray(0.5)` is weakly typed: it computes in the bfloat16 carry's
    # dtype, a float32 scalar promotes the carry. Stacked together, all four
    # became strong: the Chain failed and `unstack` computed in float32.
    keys = jr.split(jr.key(0), 4)
    w = [(0.3 * jr.normal(k, (8, 8))).astype(jnp.bfloat16) for k in keys]
    layers = [_Scaled(w[i], jnp.asarray(0.5)) for i in range(3)]
    layers.append(_Scaled(w[3], jnp.asarray(0.5, jnp.float32)))
    x = jnp.linspace(-1, 1, 8).astype(jnp.bfloat16)
    expected = x
    chain = eqxscan.Chain(layers)
    assert [tuple(g) for g in chain.layout] == [(0, 3, 1), (3, 1, 0)]
    with jax.numpy_dtype_promotion("standard"):  # JAX's default
        for layer in layers:
            expected = layer(expected)
        out = chain(x)
    assert out.dtype == expected.dtype == jnp.float32
    # bfloat16 rounding: XLA fuses the compiled call's ops, the loop's are eager.
    assert jnp.allclose(out, expected, rtol=2e-2, atol=1e-2)
    back = chain.unstack()
    assert [b.scale.weak_type for b in back] == [True, True, True, False]
    assert "`.scale`: it has float32[], layer 2 has float32[] (weakly typed)" in (
        chain.explain()
    )
    # A stack takes them (a fresh layer into a trained stack, whose optimiser
    # made its leaves strong): the stack's leaf is strongly typed.
    stack = eqxscan.Stacked.from_layers(layers)
    assert not stack.layers.scale.weak_type
    assert not stack.with_layer(0, layers[0]).layers.scale.weak_type
    # Written into a weakly typed stack, a strong leaf makes it strong too (it
    # stayed weak: the new layer computed in the dtype its scalar met).
    weak = eqxscan.Stacked.from_layers(layers[:3])
    assert weak.layers.scale.weak_type
    assert not weak.with_layer(1, layers[3]).layers.scale.weak_type
    assert weak.with_layer(1, layers[0]).layers.scale.weak_type


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_an_error_inside_a_scanned_pattern_names_the_layer_that_failed(mode):
    # The pattern's first layer widens the carry, its second expects it
    # unchanged. The message named the pattern's body and its input
    # ("one body for all 2 layers": 2 repeats of 2 layers) but no layer.
    k = jr.split(jr.key(0), 2)
    pair = [eqx.nn.Linear(8, 16, key=k[0]), eqx.nn.Linear(8, 8, key=k[1])]
    chain = eqxscan.Chain(pair * 2, mode=mode)
    assert layout(chain) == [(0, 4, 2)]
    with pytest.raises(TypeError) as info:
        chain(jnp.ones(8))
    notes = "\n".join(info.value.__notes__)
    assert "layer 1 (Linear), whose carry `carry` is float32[16]" in notes
    assert "changed from float32[8] by layer 0 (Linear)" in notes
    assert "layers 0-3 (2 repeats of pattern [Linear, Linear]" in notes
    if mode == "scan":
        assert "one body for all 2 repeats" in notes
