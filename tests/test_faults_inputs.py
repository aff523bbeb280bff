"""Bad inputs that used to end in a raw error (or none until much later) get one
headline naming the argument, layer or file, and one hint."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan


ROOT = Path(__file__).resolve().parent.parent
KEY = jax.random.key(0)


def _linear(key):
    return eqx.nn.Linear(4, 4, key=key)


@pytest.mark.parametrize("made", [None, 1.5, "layer"])
def test_make_layer_returning_no_layer_fails_at_construction(made):
    with pytest.raises(TypeError) as e:
        eqxscan.Stacked(lambda key: made, 2, key=KEY)
    first, hint = str(e.value).splitlines()
    assert first.startswith(f"make_layer returned {made!r} ({type(made).__name__})")
    assert hint.startswith("Hint: make_layer(key, ...) must return the layer")


def test_given_layers_of_another_depth_are_refused_at_construction():
    layers = eqxscan.Stacked(_linear, 4, key=KEY).layers
    # Three layers stated, four stored: refused when built, naming leaf and sizes.
    with pytest.raises(ValueError) as e:
        eqxscan.Stacked(layers=layers, num_layers=3)
    first, hint = str(e.value).splitlines()[:2]
    assert "num_layers=3, but `layers.weight` has shape (4, 4, 4)" in first
    assert hint.startswith("Hint:")
    bare = jax.tree.map(lambda a: a[0], layers)  # one layer, no layer axis
    with pytest.raises(
        ValueError, match=r"num_layers=2, but `layers.weight` has shape \(4, 4\)"
    ):
        eqxscan.Stacked(layers=bare, num_layers=2)
    assert eqxscan.Stacked(layers=layers, num_layers=4).num_layers == 4


def test_a_batch_of_stacks_is_rebuilt_without_the_check():
    # An ensemble's layers have the batch axis first: refused when built by
    # hand, but its own methods rebuild it (through `restack`) unchecked.
    keys = jax.random.split(KEY, 3)
    ens = eqx.filter_vmap(lambda k: eqxscan.Stacked(_linear, 2, key=k))(keys)
    with pytest.raises(ValueError, match="num_layers=2, but `layers.weight`"):
        eqxscan.Stacked(layers=ens.layers, num_layers=2)
    loop = ens.with_options(mode="loop")
    assert loop.options.mode == "loop" and loop.layers.weight.shape == (3, 2, 4, 4)
    x = jnp.ones((3, 4))
    call = eqx.filter_vmap(lambda s, x: s(x))
    assert jnp.allclose(call(loop, x), call(ens, x))


def test_a_callable_that_is_no_policy_is_blamed_on_checkpoint():
    with pytest.raises(TypeError) as e:
        eqxscan.Stacked(_linear, 2, key=KEY, remat=len)
    first, hint = str(e.value).splitlines()
    assert first.startswith("remat=<built-in function len> is not a remat")
    assert "Linear" not in first and hint.startswith("Hint: pass a jax.checkpoint_")
    # An uncalled factory answers with a policy, not a bool: it failed only under
    # grad, blamed on the layer.
    factory = jax.checkpoint_policies.save_only_these_names
    with pytest.raises(TypeError) as e:
        eqxscan.Stacked(_linear, 2, key=KEY, remat=factory)
    first, hint = str(e.value).splitlines()
    assert (
        "is not a rematerialisation policy: policy(primitive, *avals) answered" in first
    )
    assert hint.startswith("Hint: a policy answers True (save) or False")
    # Real policies pass the probe, and run as before.
    for policy in (
        jax.checkpoint_policies.dots_saveable,
        jax.checkpoint_policies.save_only_these_names("a"),
        jax.checkpoint_policies.nothing_saveable,
    ):
        stack = eqxscan.Stacked(_linear, 2, key=KEY, remat=policy)
        loss = lambda s, x: jnp.sum(s(x) ** 2)  # noqa: E731
        x = jnp.linspace(-1, 1, 4)
        got = jax.grad(loss, argnums=1)(stack, x)
        want = jax.grad(loss, argnums=1)(stack.with_options(mode="loop"), x)
        assert jnp.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["scan", "loop"])
@pytest.mark.parametrize("jit", [False, True])
def test_wrong_input_width_names_the_layer_and_the_input(mode, jit):
    stack = eqxscan.Stacked(_linear, 2, key=KEY, mode=mode)
    call = eqx.filter_jit(lambda s, x: s(x)) if jit else (lambda s, x: s(x))
    with pytest.raises(TypeError) as e:
        call(stack, jnp.ones(5))
    first, hint = str(e.value).splitlines()[:2]
    where = (
        "The stacked layer Linear (one body for all 2 layers)"
        if mode == "scan"
        else "Layer 0 (Linear)"
    )
    assert first.startswith(f"{where} failed on its input float32[5]: dot_general")
    assert hint.startswith("Hint: check the input's shape and dtype")
    # JAX's own error is kept as the cause.
    assert "dot_general requires contracting" in str(e.value.__cause__)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_wrong_input_width_in_run_until_names_the_input(mode):
    # The carry is named as the input, not how the run stops.
    stack = eqxscan.Stacked(_linear, 2, key=KEY, mode=mode)
    with pytest.raises(TypeError) as e:
        eqxscan.run_until(stack, jnp.ones(5), lambda c: jnp.all(c > 9))
    first = str(e.value).splitlines()[0]
    assert "failed on its input float32[5]: dot_general requires" in first, first


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_a_cell_failing_over_time_names_its_carry_not_an_input(mode):
    gru = eqx.nn.GRUCell(3, 5, key=KEY)
    rnn = eqxscan.Recurrent(lambda x, h: gru(x, h), mode=mode)  # no up-front check
    with pytest.raises(TypeError) as e:
        rnn(jnp.zeros(5), jnp.zeros((7, 4)))  # 4 features a step, the cell takes 3
    first, hint = str(e.value).splitlines()[:2]
    assert "failed on its carry float32[5]: dot_general requires" in first, first
    assert hint.startswith("Hint: check the carry's and each step's input's"), hint


def test_wrong_input_width_in_a_chain_names_the_group():
    chain = eqxscan.Chain([_linear(KEY), _linear(KEY), eqx.nn.Linear(4, 2, key=KEY)])
    with pytest.raises(TypeError) as e:
        chain(jnp.ones(3))
    first = str(e.value).splitlines()[0]
    assert "failed on its input float32[3]: dot_general requires" in first, first
    assert any("Chain layers 0-1" in n for n in e.value.__notes__), e.value.__notes__


# Without the tests' runtime type checks of annotations, as a user runs it.
UNCHECKED = """
import jax
import eqxscan

model = eqxscan.StackedMLP(4, 2, key=jax.random.key(0))
for bad in ([1, 2], None, {1: 2}, "blocks.0.w1"):
    try:
        eqxscan.from_state_dict(model, bad)
    except TypeError as e:
        print(str(e).splitlines()[0])
        print(str(e).splitlines()[1][:30])
"""


class _Dropping(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear, self.dropout = _linear(key), eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key=None):
        return self.dropout(self.linear(x), key=key, inference=key is None)


def test_a_number_field_traced_by_plain_jit_is_named():
    # Under jax.jit, Dropout's p is a 0-d array among the stacked ones: the
    # stack names it and points to eqx.filter_jit, which runs as the loop does.
    stack = eqxscan.Stacked(_Dropping, 3, key=KEY)
    x = jnp.linspace(-1, 1, 4)
    with pytest.raises(ValueError) as e:
        jax.jit(lambda s, x: s(x))(stack, x)
    first, hint = str(e.value).splitlines()
    assert "it has 3 layers, but `layers.dropout.p` has shape ()" in first, first
    assert hint.startswith("Under jax.jit") and "eqx.filter_jit" in hint, hint
    want = stack.with_options(mode="loop")(x)
    assert jnp.allclose(eqx.filter_jit(lambda s, x: s(x))(stack, x), want)


def test_wrong_type_of_state_dict_is_named():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(UNCHECKED)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    head = "from_state_dict: state_dict must be a mapping from names (str) to arrays"
    hint = "Hint: pass what eqxscan.to_sta"
    assert run.stdout.splitlines() == [
        f"{head}, got list ([1, 2]).",
        hint,
        f"{head}, got NoneType (None).",
        hint,
        f"{head}, got a mapping with keys of type ['int'].",
        hint,
        f"{head}, got str ('blocks.0.w1').",
        hint,
    ]


# When one read fails, Orbax closes its event loop while tensorstore may still
# finish other reads of the step; their callbacks then hit the closed loop and
# Python reports that as an ignored exception, at a time that varies run to run.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_orbax_data_is_named_by_step_item_and_entry(tmp_path):
    model = eqxscan.StackedMLP(4, 2, key=KEY)
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(1, model)
        c.save(2, model)
        for data in (tmp_path / "2" / "model").rglob("*"):
            if data.is_file() and data.parent.name == "d":
                data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        with pytest.raises(ValueError) as e:
            c.restore(model, mesh=mesh, step=2, min_size=0, verify=False)
        first, hint = str(e.value).splitlines()
        assert first.startswith(
            f"Step 2 in {str(tmp_path)!r} could not be read: item 'model' entry "
            "'blocks.*."
        ), first
        assert "OUT_OF_RANGE" in first or "DATA_LOSS" in first, first
        assert len(first) < 400, first  # Orbax's own runs to kilobytes
        assert hint.startswith("Hint: its files are damaged") and "[1, 2]" in hint
        # The digests name the damaged file before Orbax reads it.
        with pytest.raises(ValueError, match="Step 2 .* is corrupt: its file"):
            c.restore(model, mesh=mesh, step=2, min_size=0)
        restored, _, step = c.restore(model, mesh=mesh, step=1, min_size=0)
        assert step == 1
        for a, b in zip(
            jax.tree.leaves(eqx.filter(restored, eqx.is_array)),
            jax.tree.leaves(eqx.filter(model, eqx.is_array)),
            strict=True,
        ):
            assert jnp.array_equal(a, b)


def test_typed_prng_keys_round_trip_through_the_manager(tmp_path):
    # Orbax saved the key data, then every restore failed ('wanted key<fry>[],
    # saved uint32[2]'); then keys were refused: optax.add_noise's state, or a
    # run's key beside its model, could not be checkpointed.
    import optax

    model = {"w": jnp.ones(3), "rng": jax.random.key(5)}
    tx = optax.chain(optax.add_noise(0.1, 0.5, key=jax.random.key(3)), optax.sgd(0.1))
    opt_state = tx.init(model["w"])
    like = {"w": jnp.zeros(3), "rng": jax.random.key(0)}
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(1, model, opt_state)
        fresh = tx.init(jnp.zeros(3))
        mesh = eqxscan.sharding.make_mesh()
        restored, restored_opt, step = c.restore(like, fresh, mesh=mesh)
    assert step == 1
    data = lambda t: [  # noqa: E731
        jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for x in jax.tree.leaves(t)
    ]
    for a, b in zip(data((restored, restored_opt)), data((model, opt_state))):
        np.testing.assert_array_equal(a, b)
    assert restored["rng"].dtype == model["rng"].dtype
    # The restored noise is the saved run's, not a fresh seed's.
    grads = jnp.zeros(3)
    with jax.numpy_dtype_promotion("standard"):  # optax's step count is an int
        want, _ = tx.update(grads, opt_state)
        got, _ = tx.update(grads, restored_opt)
    assert jnp.abs(want).sum() > 0
    np.testing.assert_array_equal(got, want)


def test_a_step_saved_twice_is_named_with_a_hint_that_fits(tmp_path):
    # The hint was to check the directory's permissions and free space.
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(2, {"w": jnp.ones(3)})
        with pytest.raises(FileExistsError, match="holds a step 2 already") as e:
            c.save(2, {"w": jnp.ones(3)})
        assert "Hint: save under a step number not in it" in str(e.value)


def test_a_second_manager_sees_the_firsts_steps_and_does_not_overwrite_them(
    tmp_path,
):
    # Orbax's list of steps is its manager's own: the second one listed none,
    # and its save of step 1 replaced the first's without a word.
    Manager = eqxscan.checkpoint.CheckpointManager
    with Manager(tmp_path, asynchronous=False) as a, Manager(tmp_path) as b:
        assert b.all_steps() == []
        a.save(1, {"w": jnp.ones(3)})
        assert b.all_steps() == [1] and b.latest_step() == 1
        with pytest.raises(FileExistsError, match="holds a step 1 already"):
            b.save(1, {"w": jnp.zeros(3)})
        (tmp_path / "3").write_text("not a checkpoint")  # a stray file
        with pytest.raises(FileExistsError, match="holds a step 3 already"):
            b.save(3, {"w": jnp.zeros(3)})
        assert (tmp_path / "3").read_text() == "not a checkpoint"
        mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
        restored, _, step = a.restore({"w": jnp.zeros(3)}, mesh=mesh, step=1)
        assert step == 1 and jnp.array_equal(restored["w"], jnp.ones(3))


def test_an_optimizer_state_without_arrays_saves_and_restores(tmp_path):
    # Plain SGD's state holds no arrays: Orbax refused the empty item ('Found
    # empty item'), so no step could be saved with it.
    import optax

    model = {"w": jnp.arange(3.0)}
    sgd = optax.sgd(0.1).init(model)
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(1, model, sgd)
        restored, state, step = c.restore(model, sgd, mesh=mesh)
        assert step == 1 and state == sgd
        assert jnp.array_equal(restored["w"], model["w"])
        with pytest.raises(ValueError, match="model holds no arrays to save"):
            c.save(2, {"w": 1.0})
        # An Adam state saved, an SGD state asked for: it came back empty,
        # the saved state left unread without a word.
        c.save(3, model, optax.adam(0.1).init(model))
        with pytest.raises(
            ValueError, match=r"only in the checkpoint: opt_state\.0\.count; "
        ):
            c.restore(model, sgd, mesh=mesh, step=3)
        assert c.restore(model, None, mesh=mesh, step=3)[2] == 3  # not asked for


def test_numpy_scalars_come_back_as_numpy_scalars(tmp_path):
    # An `np.int64` count in `like` came back a 32-bit JAX array, wrapped
    # (3,000,000,123 as -1,294,967,173), from a file holding it right; so did
    # an int64 array from `restore` and `shard` (2**40 as 0).
    saved = {
        "w": jnp.arange(2.0),
        "samples": np.int64(3_000_000_123),
        "lr": np.float64(1e-3 + 1e-12),
        "rows": np.array([2**40], np.int64),
        "ids": np.array([7, 8], np.int64),  # within int32: placed by `shard`
        "scale": np.array([0.5, 2.0], np.float64),  # placed, as float32
    }
    like = {
        "w": jnp.zeros(2),
        "samples": np.int64(0),
        "lr": np.float64(0),
        "rows": np.zeros(1, np.int64),
        "ids": np.zeros(2, np.int64),
        "scale": np.zeros(2, np.float64),
    }
    eqxscan.save(tmp_path / "a.safetensors", saved)
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path / "c", asynchronous=False) as c:
        c.save(1, saved)
        restored = c.restore(like, mesh=mesh)[0]
    loaded = eqxscan.load(tmp_path / "a.safetensors", like)
    placed = eqxscan.sharding.shard(saved, mesh=mesh)[0]
    # A NumPy array a device holds is placed on the mesh, as `shard` places it
    # (`restore` keeps int64 ones NumPy: their values are not known before).
    for got, on_device in ((restored, ("scale",)), (placed, ("scale", "ids"))):
        for name in on_device:
            assert isinstance(got[name], jax.Array), name
            np.testing.assert_array_equal(got[name], saved[name])
    host = ("samples", "lr", "rows")
    for got, names in (
        (loaded, (*host, "ids", "scale")),
        (restored, (*host, "ids")),
        (placed, ("samples", "rows")),  # past int32's range
    ):
        for name in names:
            assert type(got[name]) is type(saved[name]), name
            assert got[name].dtype == saved[name].dtype, name
            np.testing.assert_array_equal(got[name], saved[name])
        assert isinstance(got["w"], jax.Array)
        np.testing.assert_array_equal(got["w"], saved["w"])


def test_a_dotted_dict_key_is_refused_before_an_orbax_save(tmp_path):
    # 'a.b' beside 'a': {'b'} saved, and both restored from one entry: the
    # ones came back as zeros.
    model = {"a": {"b": jnp.zeros(2)}, "a.b": jnp.ones(2)}
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        with pytest.raises(ValueError, match=r"entry \['a.b'\] .* contain no '\.'"):
            c.save(1, model)
        assert c.all_steps() == []


def test_a_checkpoint_directory_that_is_a_file_is_named(tmp_path):
    # The manager was made, and Orbax's background thread failed with a
    # traceback ('Not a directory') that no call raised.
    (tmp_path / "ckpt").write_text("")
    with pytest.raises(NotADirectoryError, match="/ckpt' is a file"):
        eqxscan.checkpoint.CheckpointManager(tmp_path / "ckpt")


@pytest.mark.parametrize("damaged", ["[]", "{}"])
def test_a_digest_file_that_lists_no_files_is_corruption(tmp_path, damaged):
    # A digest file damaged into valid JSON of no digests verified nothing and
    # let the step restore unchecked.
    model = {"w": jnp.ones(3)}
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(1, model)
        (tmp_path / "1" / "eqxscan_digests.json").write_text(damaged)
        with pytest.raises(ValueError, match="its digest file .* lists no files"):
            c.restore(model, mesh=mesh, step=1)
        _, _, step = c.restore(model, mesh=mesh, step=1, verify=False)
        assert step == 1


def test_an_orbax_step_restores_only_into_the_layer_order_it_was_saved_in(tmp_path):
    # A stack in stage order is saved as stored: restored into a stack in the
    # natural order (or the reverse) its layers came back permuted, silently.
    import optax

    from eqxscan.sharding import pipeline_order

    stack = eqxscan.Stacked(lambda k: eqx.nn.Linear(2, 2, key=k), 4, key=KEY)
    staged = pipeline_order(stack, stages=2, repeats=2)
    adam = optax.adam(0.1)
    mesh = eqxscan.sharding.make_mesh(devices=jax.devices()[:1])
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        c.save(1, staged, adam.init(staged))
        c.save(2, stack)
        model, _, _ = c.restore(staged, adam.init(staged), mesh=mesh, step=1)
        back = pipeline_order(model, stages=2, repeats=2, inverse=True)
        assert jnp.array_equal(back.layers.weight, stack.layers.weight)
        with pytest.raises(ValueError) as e:
            c.restore(stack, adam.init(stack), mesh=mesh, step=1)
        first, hint = str(e.value).splitlines()
        assert (
            "model '*' is saved in the stage order of pipeline_order(stack, " in first
        )
        assert "opt_state '0.mu.*' is saved in the stage order" in first
        assert hint.startswith("Hint: restore into a model (and optimizer state)")
        with pytest.raises(ValueError, match=r"model '\*' is saved in the natural"):
            c.restore(staged, mesh=mesh, step=2)


def test_a_save_failed_by_a_lost_peer_is_not_blamed_on_the_directory(tmp_path):
    # A peer killed mid-save fails its gather first: the hint was to check the
    # directory's permissions and free space.
    with eqxscan.checkpoint.CheckpointManager(tmp_path, asynchronous=False) as c:
        gloo = RuntimeError("UNKNOWN: Gloo AllGather failed: Connection closed by peer")
        message = str(c._save_failed([2], gloo))
        assert "Hint: another process of the job failed or was lost" in message
        disk = OSError(28, "No space left on device")
        assert "free space" in str(c._save_failed([2], disk))


class _ReturnsAPair(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        y = self.linear(x)
        return y, jnp.sum(y)


@pytest.mark.parametrize("mode", ["scan", "loop"])
def test_a_layer_returning_a_pair_is_described_not_printed(mode):
    # The pair's arrays were printed: tracers in a scan, values in the loop.
    stack = eqxscan.Stacked(
        lambda k: _ReturnsAPair(_linear(k)), 3, key=jax.random.key(0), mode=mode
    )
    with pytest.raises(
        TypeError,
        match=r"the input has float32\[4\] but the output has "
        r"\(float32\[4\], float32\[\]\)\. ",
    ):
        stack(jnp.ones(4))
