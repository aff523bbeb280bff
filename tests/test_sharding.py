"""eqxscan.sharding: layouts on the 2 devices of the test process, and the
8-device checks (equality, collectives, memory) in a subprocess."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqxscan
from eqxscan import adapters, quant, sharding

from .helpers import max_rel_err, run_device_script, tree_allclose
from .scripts.training import loss_fn, make_train_step


class Block(eqx.Module):
    w: jax.Array
    sq: jax.Array
    b: jax.Array
    gain: float

    def __init__(self, *, key):
        self.w = jax.random.normal(key, (6, 4))
        self.sq = jnp.eye(4)
        self.b = jnp.zeros(3)
        self.gain = 0.5


class Model(eqx.Module):
    embed: jax.Array
    odd: jax.Array
    blocks: eqxscan.Stacked

    def __init__(self, *, key):
        self.embed = jnp.ones((10, 8))
        self.odd = jnp.ones((3, 5))
        self.blocks = eqxscan.Stacked(lambda k: Block(key=k), 8, key=key)


def placed(a):
    """The PartitionSpec an array is placed with, trailing `None`s dropped."""
    spec = list(a.sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def specs(tree):
    return [
        s.spec if isinstance(s, NamedSharding) else s
        for s in jtu.tree_leaves(tree, is_leaf=lambda x: x is None)
    ]


def test_model_shardings_rules(getkey):
    mesh = sharding.make_mesh(data=1, fsdp=2)
    model = Model(key=getkey())
    out = sharding.model_shardings(model, mesh, min_size=30)
    assert jtu.tree_structure(out, is_leaf=lambda x: x is None) == jtu.tree_structure(
        eqx.filter(model, eqx.is_array), is_leaf=lambda x: x is None
    )
    # embed (10, 8): largest divisible axis is 0. odd (3, 5): 15 elements, small.
    # w (8, 6, 4): the layer axis (8, the largest) is skipped, so 6.
    # sq (8, 4, 4): a tie between axes 1 and 2, the first wins.
    # b (8, 3): 24 elements, small. gain: not an array.
    assert out.embed.spec == P("fsdp")
    assert out.odd.spec == P()
    assert out.blocks.layers.w.spec == P(None, "fsdp")
    assert out.blocks.layers.sq.spec == P(None, "fsdp")
    assert out.blocks.layers.b.spec == P()
    assert out.blocks.layers.gain is None
    assert all(s.mesh == mesh for s in jtu.tree_leaves(out))
    # Data parallelism only: everything replicated.
    dp = sharding.model_shardings(model, mesh, fsdp_axis=None, min_size=0)
    assert all(s == P() for s in specs(dp) if s is not None)
    # The default threshold replicates a model this small.
    assert all(s == P() for s in specs(sharding.model_shardings(model, mesh)) if s)
    # "Fewer than min_size elements": embed's 80 are sharded at 80, not at 81.
    assert sharding.model_shardings(model, mesh, min_size=80).embed.spec == P("fsdp")
    assert sharding.model_shardings(model, mesh, min_size=81).embed.spec == P()
    # A negative threshold is refused, not read as "shard every leaf".
    with pytest.raises(ValueError, match=r"model_shardings: min_size must be >= 0"):
        sharding.model_shardings(model, mesh, min_size=-1)
    with pytest.raises(ValueError, match=r"opt_state_shardings: min_size must be"):
        sharding.opt_state_shardings((), model, mesh, min_size=-1)


class Inner(eqx.Module):
    stack: eqxscan.Stacked

    def __init__(self, *, key):
        self.stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(4, 6, use_bias=False, key=k), 2, key=key
        )

    def __call__(self, x):
        return self.stack(x)


def test_quantized_weights_follow_the_float_weight(getkey):
    # As built and as `eval_shape` gives it (`create`, `plan`), under the tests'
    # runtime type checking: a Quantized's arrays sharded as its float weight.
    mesh = sharding.make_mesh()
    model = eqxscan.StackedMLP(16, 2, key=getkey())
    float_spec = sharding.model_shardings(model, mesh, min_size=0).blocks.layers.w1
    q = quant.quantize(model, "*.w1")
    for tree in (q, eqx.filter_eval_shape(lambda: q)):
        w1 = sharding.model_shardings(tree, mesh, min_size=0).blocks.layers.w1
        assert w1.values.spec == w1.scales.spec == float_spec.spec
    # Filtered (an optimiser's params), it has no values to give the float
    # weight's shape: its scales get the rule for any array (an AttributeError
    # from `Quantized.shape` before).
    params = eqx.filter(q, eqx.is_inexact_array)
    w1 = sharding.model_shardings(params, mesh, min_size=0).blocks.layers.w1
    assert w1.values is None and w1.scales.spec == float_spec.spec


def test_leaves_with_only_layer_axes_are_replicated(getkey):
    # min_size=0 shards every leaf that has an axis to split; a LoRA's per-layer
    # `active` ([L], as `select` makes of a traced id) and a scalar have none,
    # and are replicated rather than an error.
    mesh = sharding.make_mesh()
    model = eqxscan.StackedMLP(16, 2, key=getkey())
    lora = adapters.add_lora(model, "*.w1", rank=2, key=getkey())
    lora = eqx.tree_at(lambda m: m.blocks.layers.w1.active, lora, jnp.zeros(2, int))
    tree = (lora, jnp.ones(()))
    out = sharding.model_shardings(tree, mesh, min_size=0)
    assert out[0].blocks.layers.w1.active.spec == P() and out[1].spec == P()
    assert out[0].blocks.layers.w1.base.spec == P(None, None, "fsdp")
    placed, _, x = sharding.shard(lora, batch=jnp.ones((4, 16)), mesh=mesh, min_size=0)
    assert jnp.allclose(eqx.filter_jit(lambda m, x: m(x))(placed, x), lora(x))


def test_nested_stacked_skips_every_layer_axis(getkey):
    mesh = sharding.make_mesh(fsdp=2)
    outer = eqxscan.Stacked(lambda k: Inner(key=k), 4, key=getkey())
    # weight (4, 2, 6, 4): two layer axes, then the largest divisible axis (6).
    assert outer.layers.stack.layers.weight.shape == (4, 2, 6, 4)
    out = sharding.model_shardings(outer, mesh, min_size=0)
    assert out.layers.stack.layers.weight.spec == P(None, None, "fsdp")
    gathered = sharding.gather_layers(outer, mesh)
    assert gathered.layer_sharding == NamedSharding(mesh, P())
    assert gathered.layers.stack.layer_sharding == NamedSharding(mesh, P())
    bad = eqxscan.Stacked(
        lambda k: eqx.nn.Linear(3, 5, use_bias=False, key=k), 2, key=getkey()
    )
    nested = eqxscan.Stacked(lambda k: Inner(key=k), 2, key=getkey())
    nested = eqx.tree_at(lambda s: s.layers.stack, nested, bad)
    with pytest.raises(ValueError, match=r"axis 0 is the layer axis"):
        sharding.model_shardings(bad, mesh, min_size=0)
    odd = eqx.tree_at(
        lambda s: s.layers.stack.layers.weight, outer, jnp.ones((4, 2, 3, 5))
    )
    with pytest.raises(
        ValueError,
        match=r"`model\.layers\.stack\.layers\.weight` with shape \(4, 2, 3, 5\) "
        r"\(axes 0-1 are layer axes",
    ):
        sharding.model_shardings(odd, mesh, min_size=0)


def test_param_shardings_are_matched_by_path(getkey):
    # Matched by position, the shardings of another model's arrays (here a
    # quantized one's: w1.values, w1.scales, ...) were given to the wrong buffers.
    mesh = sharding.make_mesh()
    model = eqxscan.StackedMLP(16, 2, key=getkey())
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    other = sharding.model_shardings(quant.quantize(model, "*.w1"), mesh, min_size=0)
    with pytest.raises(ValueError, match=r"no entry for `tree\.blocks\.layers\.w1`"):
        sharding.opt_state_shardings(opt_state, model, mesh, param_shardings=other)
    # As in `constrain`, a prefix applies to everything below it.
    one = NamedSharding(mesh, P())
    out = sharding.opt_state_shardings(opt_state, model, mesh, param_shardings=one)
    assert all(s == one for s in jtu.tree_leaves(out[0].mu))


def test_opt_state_sharded_like_params(getkey):
    mesh = sharding.make_mesh(fsdp=2)
    model = eqxscan.StackedMLP(4, 2, key=getkey())
    params = eqx.filter(model, eqx.is_array)
    mask = jtu.tree_map(lambda a: a.ndim == 3, params)
    opt = optax.chain(
        optax.masked(optax.adam(1e-3), mask),
        optax.scale_by_factored_rms(),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9),
    )
    state = opt.init(params)
    out = sharding.opt_state_shardings(state, model, mesh, min_size=0)
    param_specs = sharding.model_shardings(model, mesh, min_size=0)
    expect = {
        "w1": P(None, None, "fsdp"),
        "w2": P(None, "fsdp"),
        "scale": P(None, "fsdp"),
    }
    for name, spec in expect.items():
        assert getattr(param_specs.blocks.layers, name).spec == spec
    adam = out[0].inner_state[0]
    for buf in (adam.mu, adam.nu):
        assert buf.blocks.layers.w1.spec == expect["w1"]
        assert buf.blocks.layers.w2.spec == expect["w2"]
        assert buf.blocks.layers.scale is None  # masked out: no array
    assert adam.count.spec == P()
    momentum = out[2].inner_state[0].trace
    for name, spec in expect.items():
        assert getattr(momentum.blocks.layers, name).spec == spec
    assert out[2].hyperparams["learning_rate"].spec == P()
    # Factored moments of shape (1,) cannot be split: replicated, not an error.
    factored = out[1]
    assert factored.v_row.blocks.layers.w1.spec == P()
    # Every array leaf got a sharding, every other leaf None.
    for s, leaf in zip(
        jtu.tree_leaves(out, is_leaf=lambda x: x is None),
        jtu.tree_leaves(
            state, is_leaf=lambda x: x is None or isinstance(x, optax.MaskedNode)
        ),
        strict=True,
    ):
        assert isinstance(s, NamedSharding) == eqx.is_array(leaf)


def test_factored_moments_that_no_axis_divides_are_replicated(getkey):
    # weight [2, 4, 3] is split along 4; its factored moments [2, 3] (which 2
    # does not divide) and [2, 4] take the rule for their own shapes.
    mesh = sharding.make_mesh(fsdp=2)
    model = eqxscan.Stacked(lambda k: eqx.nn.Linear(3, 4, key=k), 2, key=getkey())
    opt = optax.scale_by_factored_rms(min_dim_size_to_factor=2)
    state = opt.init(eqx.filter(model, eqx.is_array))
    out = sharding.opt_state_shardings(state, model, mesh, min_size=0)
    assert state.v_row.layers.weight.shape == (2, 3)
    assert out.v_row.layers.weight.spec == P()
    assert out.v_col.layers.weight.spec == P(None, "fsdp")


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_two_device_step_matches_one_device(getkey, axis_type):
    model = eqxscan.StackedMLP(8, 3, key=getkey())
    x = jax.random.normal(getkey(), (4, 8))
    y = jax.random.normal(getkey(), (4, 8))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    ref = make_train_step(optimizer, None)(model, opt_state, x, y)

    mesh = jax.make_mesh((1, 2), ("data", "fsdp"), axis_types=(axis_type,) * 2)
    s_model, s_state, (s_x, s_y) = sharding.shard(
        model, opt_state, (x, y), mesh=mesh, min_size=0
    )
    assert placed(s_model.blocks.layers.w1) == P(None, None, "fsdp")
    assert s_model.blocks.layer_sharding == NamedSharding(mesh, P())
    assert placed(s_state[0].mu.blocks.layers.w2) == P(None, "fsdp")
    assert placed(s_x) == P(("data", "fsdp"))
    new_model, new_state, loss, grads = make_train_step(optimizer, mesh)(
        s_model, s_state, s_x, s_y
    )
    assert abs(float(loss) - float(ref[2])) <= 1e-5 * abs(float(ref[2]))
    assert (
        max_rel_err(eqx.filter(grads, eqx.is_array), eqx.filter(ref[3], eqx.is_array))
        < 1e-5
    )
    assert (
        max_rel_err(
            eqx.filter(new_model, eqx.is_array), eqx.filter(ref[0], eqx.is_array)
        )
        < 1e-5
    )
    assert placed(new_model.blocks.layers.w1) == P(None, None, "fsdp")
    assert placed(new_state[0].nu.blocks.layers.w1) == P(None, None, "fsdp")
    # The placed model computes what the unplaced one does.
    assert tree_allclose(s_model(x), model(x))


def test_shard_is_idempotent_and_keeps_opt_state_usable(getkey):
    mesh = sharding.make_mesh(fsdp=2)
    model = eqxscan.StackedMLP(4, 2, key=getkey())
    optimizer = optax.sgd(0.1, momentum=0.9)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    m1, s1, _ = sharding.shard(model, state, mesh=mesh, min_size=0)
    m2, s2, b2 = sharding.shard(m1, s1, mesh=mesh, min_size=0)
    assert b2 is None
    assert jtu.tree_structure(m1) == jtu.tree_structure(m2)
    assert jtu.tree_structure(s1) == jtu.tree_structure(s2)
    # The momentum buffer has the new model's structure (layer_sharding included),
    # so optax accepts its gradients.
    assert s1[0].trace.blocks.layer_sharding == m1.blocks.layer_sharding
    grads = eqx.filter_grad(loss_fn)(m1, jnp.ones((2, 4)), jnp.zeros((2, 4)))
    optimizer.update(grads, s1, eqx.filter(m1, eqx.is_array))
    # Data parallelism only: nothing sharded, no per-step gather.
    m3, _, _ = sharding.shard(model, mesh=mesh, fsdp_axis=None)
    assert m3.blocks.layer_sharding is None
    assert placed(m3.blocks.layers.w1) == P()


def test_sharding_over_one_device_keeps_the_unsharded_program(getkey):
    # A one-device mesh (as a checkpoint's restore places a model) gathers
    # nothing: the step is the unsharded one, bit for bit, so a run resumed
    # that way continues the run it saved.
    model = eqxscan.StackedMLP(8, 3, key=getkey())
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    placed_model, _, _ = sharding.shard(model, mesh=one, min_size=0)
    assert placed_model.blocks.layer_sharding is not None
    x, y = jnp.ones((2, 8)), jnp.zeros((2, 8))
    choice = lambda m: eqxscan.explain_auto(m, x)[0]  # noqa: E731
    assert choice(placed_model).rule == choice(model).rule  # (1 == True in Python)
    step = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    got, want = step(placed_model, x, y), step(model, x, y)
    for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(want)):
        assert (a == b).all()


def test_which_layer_shardings_may_gather():
    from eqxscan._helpers.constrain import spans_devices

    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    two = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("fsdp",))
    assert not spans_devices(None) and not spans_devices(NamedSharding(one, P("fsdp")))
    # A gathered layer is replicated, its storage split: over two devices.
    assert spans_devices({"w": NamedSharding(two, P())})
    assert spans_devices(NamedSharding(two, P(P.UNCONSTRAINED)))


def test_shard_regroups_the_buffers_of_a_model_kept_beside_other_values(getkey):
    # The model saved in a dict with an RNG key (CheckpointManager's `model`
    # item is any pytree): the optimizer's buffers are the model's alone, and
    # were left without its layer sharding, so the next update failed.
    mesh = sharding.make_mesh(fsdp=2)
    model = eqxscan.StackedMLP(4, 2, key=getkey())
    optimizer = optax.adam(0.1)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    rng = jax.random.key_data(getkey())
    # One level down, or deeper (a run's state: {"train": [model, step]}).
    for tree, at in [
        ({"model": model, "rng": rng}, lambda t: t["model"]),
        ({"train": [model, 0], "rng": rng}, lambda t: t["train"][0]),
    ]:
        placed, placed_state, _ = sharding.shard(tree, state, mesh=mesh, min_size=0)
        m = at(placed)
        assert m.blocks.layer_sharding is not None
        assert placed_state[0].mu.blocks.layer_sharding == m.blocks.layer_sharding
        shardings = sharding.opt_state_shardings(state, tree, mesh, min_size=0)
        arrays = eqx.filter(model, eqx.is_array)
        want = sharding.model_shardings(arrays, mesh, min_size=0)
        assert shardings[0].mu.blocks.layers.w1 == want.blocks.layers.w1
        grads = eqx.filter_grad(loss_fn)(m, jnp.ones((2, 4)), jnp.zeros((2, 4)))
        with jax.numpy_dtype_promotion("standard"):
            optimizer.update(grads, placed_state, eqx.filter(m, eqx.is_array))


def test_data_parallel_shard_drops_a_layer_sharding_of_another_mesh(getkey):
    # Placed for FSDP on one mesh, then data parallel on another device: the
    # stack kept the first mesh's layer_sharding, and jit refused the devices.
    model = eqxscan.StackedMLP(4, 2, key=getkey())
    first, second = jax.devices()[:2]
    fsdp, _, _ = sharding.shard(model, mesh=sharding.make_mesh(fsdp=2), min_size=0)
    assert fsdp.blocks.layer_sharding is not None
    other = sharding.make_mesh(devices=[second])
    moved, _, _ = sharding.shard(fsdp, mesh=other, fsdp_axis=None)
    assert moved.blocks.layer_sharding is None
    x = jnp.ones((2, 4))
    assert tree_allclose(eqx.filter_jit(lambda m, x: m(x))(moved, x), model(x))
    # A layer sharding of the same mesh stays (tensor parallel, say).
    mesh = sharding.make_mesh(fsdp=2)
    again, _, _ = sharding.shard(fsdp, mesh=mesh, fsdp_axis=None)
    assert again.blocks.layer_sharding == fsdp.blocks.layer_sharding


def test_shard_moves_arrays_committed_elsewhere(getkey):
    # Committed arrays (`device_put` to one device, or placed on another mesh)
    # are moved, as `jax.device_put` moves them, not refused by `jit`.
    model = eqxscan.StackedMLP(4, 2, key=getkey())
    first, second = jax.devices()[:2]
    mesh = sharding.make_mesh(fsdp=2)
    batch = jax.device_put(jnp.ones((2, 4)), second)
    arrays, static = eqx.partition(model, eqx.is_array)
    committed = eqx.combine(jax.device_put(arrays, first), static)
    m, _, b = sharding.shard(committed, batch=batch, mesh=mesh, min_size=0)
    fresh, _, _ = sharding.shard(model, mesh=mesh, min_size=0)
    assert placed(m.blocks.layers.w1) == placed(fresh.blocks.layers.w1) != P()
    assert b.sharding.mesh == mesh and tree_allclose(m(b), model(batch))
    mesh_a, mesh_b = (sharding.make_mesh(devices=[d]) for d in (first, second))
    on_a, _, _ = sharding.shard(model, mesh=mesh_a)
    on_b, _, _ = sharding.shard(on_a, mesh=mesh_b)
    assert on_b.blocks.layers.w1.devices() == {second}
    leaves = [jtu.tree_leaves(eqx.filter(t, eqx.is_array)) for t in (on_b, model)]
    assert all(map(jnp.array_equal, *leaves))


def test_a_batch_of_stacks_is_refused_not_split_along_its_layers(getkey):
    # An ensemble's member axis would be read as the layer axis, and the real
    # layer axis sharded.
    keys = jax.random.split(getkey(), 3)
    ensemble = eqx.filter_vmap(lambda k: eqxscan.StackedMLP(4, 2, key=k))(keys)
    mesh = sharding.make_mesh(fsdp=2)
    match = r"`model\.blocks\.layers\.w1` has shape \(3, 2, 4, 16\).*axes \(2,\)"
    with pytest.raises(ValueError, match=match):
        sharding.model_shardings(ensemble, mesh, min_size=0)


def test_layer_sharding_option(getkey):
    mesh = sharding.make_mesh(fsdp=2)
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=getkey())
    assert stack.layer_sharding is None
    replicated = NamedSharding(mesh, P())
    gathered = stack.with_options(layer_sharding=replicated)
    assert gathered.layer_sharding == replicated
    assert gathered[1:].layer_sharding == replicated
    assert gathered.with_options(unroll=2).layer_sharding == replicated
    x = jnp.arange(4.0)
    assert tree_allclose(eqx.filter_jit(lambda s, x: s(x))(gathered, x), stack(x))
    # (Under the test suite's runtime type checking, beartype speaks first.)
    with pytest.raises(
        TypeError,
        match=r"layer_sharding must be a jax.sharding|parameter 'layer_sharding'",
    ):
        stack.with_options(layer_sharding=P())


def test_batch_shardings(getkey):
    mesh = sharding.make_mesh(data=2, fsdp=1)
    batch = {"x": jnp.ones((4, 3)), "n": 3, "y": jnp.ones(4, jnp.int32)}
    out = sharding.batch_shardings(batch, mesh)
    assert out["x"].spec == P(("data", "fsdp")) and out["n"] is None
    assert sharding.batch_shardings(batch, mesh, batch_axes="data")["y"].spec == P(
        "data"
    )
    assert sharding.batch_shardings(batch, mesh, fsdp_axis=None)["x"].spec == P("data")
    with pytest.raises(
        ValueError,
        match=r"`batch\['x'\]` with shape \(3, 2\) over mesh axes \('data', 'fsdp'\) "
        r"\(total size 2.*batch size 3, and axis 0 must be a multiple of 2",
    ):
        sharding.batch_shardings({"x": jnp.ones((3, 2))}, mesh)
    with pytest.raises(ValueError, match=r"`batch\[0\]`.*it has a scalar"):
        sharding.batch_shardings([jnp.float32(1)], mesh)


def test_errors(getkey):
    mesh = sharding.make_mesh(fsdp=2)
    model = eqxscan.StackedMLP(3, 2, key=getkey())  # w1 (2, 3, 12), scale (2, 3)
    with pytest.raises(
        ValueError,
        match=r"Cannot shard `model\.blocks\.layers\.scale` with shape \(2, 3\) "
        r"\(axis 0 is the layer axis .*mesh axis 'fsdp' of size 2: none of its "
        r"axes \(3,\) divides by 2",
    ):
        sharding.shard(model, mesh=mesh, min_size=0)
    with pytest.raises(
        ValueError,
        match=r"fsdp_axis names mesh axis 'model', but the mesh has axes "
        r"\('data', 'fsdp'\).*fsdp_axis=None",
    ):
        sharding.model_shardings(model, mesh, fsdp_axis="model")
    with pytest.raises(ValueError, match=r"batch_axes names mesh axis 'batch'"):
        sharding.shard(model, batch=jnp.ones((2, 3)), mesh=mesh, batch_axes="batch")
    other = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
    with pytest.raises(ValueError, match=r"sharded over the mesh axes \('data',\)"):
        sharding.batch_shardings(jnp.ones((2, 3)), other, fsdp_axis=None)
    # (Under the test suite's runtime type checking, beartype speaks first.)
    with pytest.raises(
        TypeError, match=r"mesh must be a jax.sharding.Mesh|parameter 'mesh'"
    ):
        sharding.shard(model, mesh="fsdp")
    with pytest.raises(ValueError, match=r"data=3 does not divide the 2 devices"):
        sharding.make_mesh(data=3)
    with pytest.raises(ValueError, match=r"data=1 x fsdp=1 needs 1 devices, but 2"):
        sharding.make_mesh(1, 1)
    with pytest.raises(ValueError, match="fsdp must be a positive int"):
        sharding.make_mesh(fsdp=0)
    with pytest.raises(ValueError, match=r"got device .* more than once in devices"):
        sharding.make_mesh(devices=[jax.devices()[0]] * 2)
    with pytest.raises(ValueError, match=r"got no devices in devices"):
        sharding.make_mesh(devices=[])
    with pytest.raises(TypeError, match="shardings must be jax.sharding.Sharding"):
        sharding.constrain(jnp.ones(2), P())
    with pytest.raises(
        TypeError, match=r"got P for `tree\['w'\]`\.\nHint: .*mesh, spec"
    ):
        sharding.constrain({"w": jnp.ones(2)}, {"w": P()})


def test_make_mesh():
    mesh = sharding.make_mesh()
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2}
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert dict(sharding.make_mesh(data=2).shape) == {"data": 2, "fsdp": 1}
    one = sharding.make_mesh(devices=jax.devices()[:1])
    assert dict(one.shape) == {"data": 1, "fsdp": 1}


@pytest.fixture(scope="module")
def eight_devices():
    return run_device_script("sharding_checks.py", timeout=900)


def test_eight_devices_equal_one_device(eight_devices):
    for run in eight_devices["runs"]:
        assert run["err_loss"] < 1e-5, run
        assert run["err_grads"] < 1e-5, run
        assert run["err_params"] < 1e-5, run
        assert run["err_opt_state"] < 1e-5, run
        # The updated parameters keep their layout step after step.
        assert run["out_specs"] == run["in_specs"], run
    specs = {r["name"]: r["in_specs"] for r in eight_devices["runs"]}
    assert specs["data"] == ["P()"] * 3
    assert specs["fsdp"] == [
        "P(None, None, 'fsdp')",
        "P(None, 'fsdp')",
        "P(None, 'fsdp')",
    ]


def _unlayered(shape: str) -> str:
    # f32[1,16,64] (one layer, keeping a unit layer axis) -> f32[16,64]
    return shape.replace("[1,", "[")


def test_eight_devices_collectives(eight_devices):
    runs = {r["name"]: r for r in eight_devices["runs"]}
    w1, w2 = eight_devices["shapes"]["layer_w1"], eight_devices["shapes"]["layer_w2"]
    for name in ("fsdp", "hybrid"):
        gathers = [_unlayered(s) for s in runs[name]["body_all_gathers"]]
        # One layer's weights are all-gathered inside the loop (forward and the
        # backward's recomputation); the whole stack never is.
        assert gathers.count(w1) >= 2 and gathers.count(w2) >= 2, gathers
        assert not any(s.startswith("f32[3,") for s in gathers), gathers
    for name in ("data", "fsdp", "hybrid"):
        # Each layer's gradients are reduced across devices inside the backward loop.
        reduced = runs[name]["body_all_reduces"] + runs[name]["body_reduce_scatters"]
        assert any(w1 in s or _unlayered(s) == w1 for s in reduced), reduced
    assert runs["data"]["body_all_gathers"] == []
    # Without `layer_sharding`, XLA keeps the weights sharded and gathers
    # activations instead: no weight-shaped all-gather in the loop.
    without = [_unlayered(s) for s in eight_devices["without_gather"]]
    assert w1 not in without and w2 not in without, without


def test_eight_devices_memory(eight_devices):
    runs = {r["name"]: r for r in eight_devices["runs"]}
    for r in runs.values():
        # memory_analysis agrees with the shard shapes of the arguments.
        assert r["arg_bytes"] == r["expected_shard_bytes"], r
    ref = runs["fsdp"]["ref_arg_bytes"]  # params + Adam's mu, nu + batch, 1 device
    # FSDP over 8: every argument but Adam's step count is split 8 ways.
    assert runs["fsdp"]["arg_bytes"] <= ref / 8 + 16, runs["fsdp"]
    # Hybrid 2 x 4: parameters and optimizer state split 4 ways, batch 8 ways.
    assert runs["hybrid"]["arg_bytes"] <= ref / 4 + 16, runs["hybrid"]
    # Data parallel: parameters and optimizer state replicated.
    assert runs["data"]["arg_bytes"] >= 3 * runs["data"]["weight_bytes"]


def test_eight_devices_errors(eight_devices):
    msgs = eight_devices["errors"]
    assert "`model.blocks.layers.scale` with shape (2, 6)" in msgs["indivisible"]
    assert "mesh axis 'fsdp' of size 4" in msgs["indivisible"]
    assert "none of its axes (6,) divides by 4" in msgs["indivisible"]
    assert "`batch` with shape (12, 6)" in msgs["batch"]
    assert "total size 8" in msgs["batch"] and "multiple of 8" in msgs["batch"]
    assert "needs 4 devices, but 8 are given" in msgs["mesh"]


def test_eight_devices_pipeline(eight_devices):
    result = eight_devices["pipeline"]
    assert result["err_value"] < 1e-5 and result["err_grads"] < 1e-5, result
    # One microbatch (4 rows of 16) moves between stages inside the tick loop,
    # forwards and (transposed) backwards.
    assert result["body_permutes"].count("f32[4,16]") >= 2, result


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_pipeline_two_stages(getkey, axis_type):
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(axis_type,))
    stack = eqxscan.StackedMLP(8, 4, key=getkey()).blocks
    x = jax.random.normal(getkey(), (6, 8))

    def loss(stack, x, microbatches):
        if microbatches:
            y = sharding.pipeline(stack, x, mesh=mesh, microbatches=microbatches)
        else:
            y = stack(x)
        return jnp.sum(jnp.sin(y))

    grad = eqx.filter_value_and_grad(lambda sx, m: loss(*sx, m))
    ref_value, (ref_gs, ref_gx) = grad((stack, x), 0)
    fn = eqx.filter_jit(grad)
    for microbatches in (1, 3):
        value, (gs, gx) = fn((stack, x), microbatches)
        assert abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value))
        assert max_rel_err(gx, ref_gx) < 1e-5
        assert (
            max_rel_err(eqx.filter(gs, eqx.is_array), eqx.filter(ref_gs, eqx.is_array))
            < 1e-5
        )


def test_pipeline_errors(getkey):
    mesh = jax.make_mesh((2,), ("stage",), axis_types=(AxisType.Auto,))
    stack = eqxscan.StackedMLP(4, 3, key=getkey()).blocks
    x = jnp.ones((4, 4))
    with pytest.raises(
        ValueError, match=r"3 layers of a Stacked into 2 pipeline stages"
    ):
        sharding.pipeline(stack, x, mesh=mesh, microbatches=2)
    with pytest.raises(ValueError, match=r"shape \(4, 4\) into 3 microbatches"):
        sharding.pipeline(stack[:2], x, mesh=mesh, microbatches=3)
    with pytest.raises(ValueError, match=r"stage_axis names mesh axis 'pipe'"):
        sharding.pipeline(stack[:2], x, mesh=mesh, microbatches=2, stage_axis="pipe")
    # (Under the test suite's runtime type checking, beartype speaks first.)
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh|'mesh'"):
        sharding.pipeline(stack[:2], x, mesh=None, microbatches=2)
    with pytest.raises(TypeError, match=r"pipeline runs an eqxscan.Stacked|'stack'"):
        sharding.pipeline(stack[0], x, mesh=mesh, microbatches=2)


class Square(eqx.Module):
    stack: eqxscan.Stacked

    def __init__(self, *, key):
        self.stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 2, key=key)

    def __call__(self, x):
        return self.stack(x)


def _tp_mesh():
    return jax.make_mesh((1, 2), ("fsdp", "model"), axis_types=(AxisType.Auto,) * 2)


def _tp_specs(model, mesh):
    # Two layer axes, then "fsdp" and "model" on one axis of the weight.
    def one(a):
        spec = P(None, None, ("fsdp", "model")) if a.ndim == 4 else P(None, "model")
        return NamedSharding(mesh, spec)

    return jtu.tree_map(one, eqx.filter(model, eqx.is_array))


def test_gather_layers_keep(getkey):
    mesh = _tp_mesh()
    outer = eqxscan.Stacked(lambda k: Square(key=k), 3, key=getkey())
    specs = _tp_specs(outer, mesh)
    gathered = sharding.gather_layers(outer, mesh, specs, keep="model")
    # The outer step drops the outer layer axis and every axis but "model"; the
    # inner step drops both layer axes.
    step = gathered.layer_sharding.stack.layers
    assert step.weight.spec == P(None, "model") and step.bias.spec == P("model")
    inner = gathered.layers.stack.layer_sharding
    assert inner.weight.spec == P("model") and inner.bias.spec == P()
    # The same from the arrays' own placement.
    placed = sharding.constrain(outer, specs)
    again = sharding.gather_layers(placed, mesh, keep=("model",))
    assert again.layer_sharding == gathered.layer_sharding
    assert again.layers.stack.layer_sharding == inner
    # A prefix of the model works too: one sharding for every array.
    one = NamedSharding(mesh, P(None, None, "model"))
    prefixed = sharding.gather_layers(outer, mesh, one, keep="model")
    assert prefixed.layer_sharding.stack.layers.weight.spec == P(None, "model")
    assert prefixed.layers.stack.layer_sharding.bias.spec == P("model")
    # Without keep: one replicated sharding, as before.
    assert sharding.gather_layers(outer, mesh).layer_sharding == NamedSharding(
        mesh, P()
    )
    # Shardings computed before gather_layers still place the model (by key
    # path: layer_sharding is static), and values and gradients are unchanged.
    gathered = sharding.constrain(gathered, specs)
    assert (
        gathered.layers.stack.layers.weight.sharding.spec
        == specs.layers.stack.layers.weight.spec
    )
    x = jnp.linspace(-1.0, 1.0, 4)
    f = eqx.filter_jit(eqx.filter_value_and_grad(lambda m: jnp.sum(jnp.tanh(m(x)))))
    (v1, g1), (v2, g2) = f(gathered), f(outer)
    assert jnp.allclose(v1, v2, rtol=1e-6) and max_rel_err(g1, g2) < 1e-6


def test_gather_layers_keep_errors(getkey):
    mesh = _tp_mesh()
    outer = eqxscan.Stacked(lambda k: Square(key=k), 3, key=getkey())
    with pytest.raises(ValueError, match=r"keep names mesh axis 'tp'"):
        sharding.gather_layers(outer, mesh, keep="tp")
    with pytest.raises(
        ValueError,
        match=r"needs `model\.layers\.stack\.layers\.weight`'s NamedSharding on "
        r"this mesh, but it is placed on SingleDeviceSharding",
    ):
        sharding.gather_layers(outer, mesh, keep="model")


def test_layer_sharding_pytree_checked(getkey):
    mesh = _tp_mesh()
    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(4, 4, key=k), 3, key=getkey())
    per_leaf = jtu.tree_map(
        lambda a: NamedSharding(mesh, P()), eqx.filter(stack.layers, eqx.is_array)
    )
    assert stack.with_options(layer_sharding=per_leaf).layer_sharding == per_leaf
    with pytest.raises(ValueError, match=r"does not match the layers' arrays"):
        stack.with_options(layer_sharding=(NamedSharding(mesh, P()),) * 2)
    with pytest.raises(TypeError, match=r"static field, so it must be hashable"):
        stack.with_options(layer_sharding={"weight": NamedSharding(mesh, P())})


def test_constrain_matches_by_path(getkey):
    mesh = sharding.make_mesh(fsdp=2)
    model = eqxscan.StackedMLP(8, 3, key=getkey())
    specs = sharding.model_shardings(model, mesh, min_size=0)
    placed, _, _ = sharding.shard(model, mesh=mesh, min_size=0)
    # `shard` set layer_sharding (static); specs computed before still fit.
    again = sharding.constrain(placed, specs)
    assert again.blocks.layer_sharding == NamedSharding(mesh, P())
    assert again.blocks.layers.w1.sharding.spec == specs.blocks.layers.w1.spec
    with pytest.raises(ValueError, match=r"shardings has no entry for `tree\."):
        sharding.constrain(placed, {"other": specs})
    # JAX's own functions match static fields too: the shardings of the placed
    # model, the same NamedShardings, are the ones for them.
    arrays = eqx.filter(placed, eqx.is_array)
    with pytest.raises(ValueError):  # a pytree structure error at `.blocks`
        jax.device_put(arrays, specs)
    after = sharding.model_shardings(placed, mesh, min_size=0)
    assert jax.tree.leaves(after) == jax.tree.leaves(specs)
    assert (
        jax.device_put(arrays, after).blocks.layers.w1.sharding
        == after.blocks.layers.w1
    )
