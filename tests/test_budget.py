"""`fit_remat` (remat chosen for a memory budget) and `remat="offload"`."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxscan
from eqxscan._scan import auto as _auto
from eqxscan.remat._budget import CANDIDATES, choose, parse_bytes, with_remat
from eqxscan.remat._devices import Peak

from .helpers import tree_allclose, untyped


def _mse_step(model, x):
    def loss(m):
        return jnp.mean(m(x) ** 2)

    return eqx.filter_value_and_grad(loss)(model)


@pytest.fixture(scope="module")
def mlp_problem():
    model = eqxscan.StackedMLP(8, 12, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 5, 8))
    return model, x


@pytest.fixture(scope="module")
def mlp_table(mlp_problem):
    model, x = mlp_problem
    return eqxscan.remat.remat_table(model, _mse_step, "1GiB", x)


# remat="offload"


def _arrays(tree):
    # The gradients' static fields carry the (differing) remat settings.
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _elman_model(key):
    k1, k2 = jax.random.split(key)
    return (
        eqxscan.StackedMLP(4, 2, key=k1),
        eqxscan.Recurrent(eqxscan.ElmanCell(4, 4, key=k2)),
    )


def _two_part_loss(models, x):
    mlp, rnn = models
    h, ys = rnn(jnp.zeros(4), mlp(x))
    return jnp.mean(ys**2) + jnp.sum(h**2)


@pytest.mark.parametrize("compare", [dict(remat=False), dict(mode="loop")])
def test_offload_gives_the_same_values_and_gradients(compare, getkey):
    models = _elman_model(getkey())
    x = jax.random.normal(getkey(), (5, 4))
    step = eqx.filter_jit(eqx.filter_value_and_grad(_two_part_loss))
    offload = with_remat(models, "offload")
    assert offload[0].blocks.remat == "offload"
    assert offload[1].remat == "offload"
    other = jax.tree.map(
        lambda m: m.with_options(**compare),
        models,
        is_leaf=lambda m: isinstance(m, (eqxscan.Stacked, eqxscan.Recurrent)),
    )
    loss, grads = step(offload, x)
    loss_ref, grads_ref = step(other, x)
    assert jnp.allclose(loss, loss_ref, rtol=1e-6)
    assert tree_allclose(_arrays(grads), _arrays(grads_ref), rtol=1e-5, atol=1e-7)


def test_offload_moves_the_saved_matmuls_to_the_host(getkey):
    # The traced step moves the saved matmul outputs to host memory and back
    # (the CPU backend then lowers the moves to nothing: one memory there).
    x = jnp.ones((2, 8))
    grad = eqx.filter_grad(lambda m: jnp.sum(m(x)))
    jaxprs = {
        remat: str(
            eqx.filter_make_jaxpr(grad)(
                eqxscan.StackedMLP(8, 3, key=getkey(), remat=remat)
            )[0]
        )
        for remat in ("offload", "auto")
    }
    assert "f32<host>[2,32]" in jaxprs["offload"]
    assert "<host>" not in jaxprs["auto"]


def test_offload_is_a_valid_option_and_typos_are_not():
    layer = lambda k: eqx.nn.Linear(4, 4, key=k)  # noqa: E731
    stacked = eqxscan.Stacked(layer, 2, key=jax.random.key(0), remat="offload")
    assert stacked.remat == "offload"
    with pytest.raises(ValueError, match="remat must be one of .*'offload'"):
        eqxscan.Stacked(layer, 2, key=jax.random.key(0), remat="offloaded")


# parse_bytes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("6GiB", 6 * 2**30),
        ("512MB", 512 * 10**6),
        ("1.5 kib", 1536),
        (" 100 ", 100),
        (4096, 4096),
        (np.int64(2**30), 2**30),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["6 gigs", "-1GB", "GiB", "0.5B", "0 GiB", 0, -5, True])
def test_parse_bytes_rejects(bad):
    # "0.5B" is less than a byte: refused, not read as a budget of 0.
    with pytest.raises(ValueError, match="budget must be a positive int number"):
        parse_bytes(bad)


# fit_remat


def test_table_lists_every_candidate_from_xla(mlp_problem, mlp_table):
    model, x = mlp_problem
    assert [c.remat for c in mlp_table.candidates] == list(CANDIDATES)
    # Identical programs are compiled once: "auto" resolves (from the step's
    # shapes) to one of the explicit settings, and shares its program.
    assert mlp_table.compiles < len(CANDIDATES)
    by = {c.label: c for c in mlp_table.candidates}
    auto = by["'auto'"].compiled
    assert any(c.compiled is auto for c in mlp_table.candidates if c.label != "'auto'")
    # XLA's figures are read from the compiled program, and they differ the way
    # the settings do: saving everything needs the most temp memory, True the least
    # of the flat scans, and True recomputes the matmuls (more FLOPs).
    dots = by["'offload'"]  # the matmul policy's program: the CPU has no host memory
    assert by["False"].temp_bytes > dots.temp_bytes > by["True"].temp_bytes
    assert by["True"].flops > dots.flops
    compiled = eqx.filter_jit(_mse_step).lower(model, x).compile().compiled
    assert by["'auto'"].temp_bytes == compiled.memory_analysis().temp_size_in_bytes
    mem = by["'auto'"].compiled.memory_analysis()
    assert by["'auto'"].device_bytes == (
        mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    )
    assert "| 'nested' |" in str(mlp_table) and "**chosen**" in str(mlp_table)


def test_chooses_the_cheapest_fitting_candidate(mlp_problem, mlp_table):
    model, x = mlp_problem
    sizes = {c.label: c.device_bytes for c in mlp_table.candidates}
    assert sizes["True"] < sizes["False"]
    # With FLOPs made dear the estimate ranks by FLOPs: False (no recomputation)
    # wins where it fits, True (recomputes the forward) where only it fits.
    peak = Peak(1e6, 1e15)
    chosen_labels = []
    for budget in (2**30, sizes["True"]):
        table = eqxscan.remat.remat_table(
            model, _mse_step, budget, x, peak=peak, candidates=(True, False)
        )
        got = eqxscan.remat.fit_remat(
            model, _mse_step, budget, x, peak=peak, candidates=(True, False)
        )
        fitting = [c for c in table.candidates if c.device_bytes <= budget]
        assert table.chosen in fitting
        assert table.chosen.estimated_s == min(c.estimated_s for c in fitting)
        assert got.blocks.remat is table.chosen.remat
        chosen_labels.append(table.chosen.label)
    assert chosen_labels == ["False", "True"]
    # Only the setting changes: same values and gradients as the input model.
    assert tree_allclose(
        _arrays(_mse_step(got, x)), _arrays(_mse_step(model, x)), rtol=1e-5
    )


def test_a_budget_nothing_fits_lists_every_candidate(mlp_problem, mlp_table):
    model, x = mlp_problem
    with pytest.raises(ValueError) as info:
        eqxscan.remat.fit_remat(model, _mse_step, "1kB", x, candidates=("auto", True))
    message = str(info.value)
    # Below a KiB in bytes alone (it read "0.0 KiB (1 bytes)" for one byte).
    assert "no remat setting fits the budget of 1000 bytes. Temp" in message
    # Each candidate's bytes, legible at any size (not "0.0 MiB").
    for c in mlp_table.candidates:
        if c.remat in ("auto", True):
            assert f"{c.label}: {c.device_bytes / 2**10:.1f} KiB" in message
    assert "see https://eqxscan.readthedocs.io/en/latest/remat/." in message


def test_time_steps_chooses_by_measured_time(mlp_problem):
    model, x = mlp_problem
    table = eqxscan.remat.remat_table(
        model, _mse_step, "1GiB", x, candidates=("auto", False), time_steps=2
    )
    assert all(c.measured_s is not None and c.measured_s > 0 for c in table.candidates)
    assert table.chosen.measured_s == min(c.measured_s for c in table.candidates)
    got = table.chosen.apply(model)
    assert got.blocks.remat is table.chosen.remat


def test_unrolls_are_tried_with_every_candidate(getkey):
    rnn = eqxscan.Recurrent(eqx.nn.GRUCell(3, 8, key=getkey()))
    h0, xs = jnp.zeros((4, 8)), jax.random.normal(getkey(), (4, 10, 3))
    step = eqx.filter_value_and_grad(
        lambda m, h0, xs: jnp.mean(jax.vmap(m)(h0, xs)[1] ** 2)
    )
    table = eqxscan.remat.remat_table(
        rnn,
        step,
        "1GiB",
        h0,
        xs,
        candidates=(True, False),
        unrolls=(1, 2),
        time_steps=3,
    )
    got = table.chosen.apply(rnn)
    assert [c.label for c in table.candidates] == [
        "True, unroll=1",
        "True, unroll=2",
        "False, unroll=1",
        "False, unroll=2",
    ]
    assert table.compiles == 4  # unrolling changes the program
    assert table.chosen.measured_s == min(c.measured_s for c in table.candidates)
    assert (got.remat, got.unroll) == (
        table.chosen.remat,
        table.chosen.unroll,
    )
    # Only the settings change: the same loss and gradients.
    leaves = lambda m: jax.tree.leaves(eqx.filter(step(m, h0, xs), eqx.is_array))
    assert tree_allclose(leaves(got), leaves(rnn), rtol=1e-5)
    # Without `unrolls` the model's own unroll is kept, and labels say nothing.
    table = eqxscan.remat.remat_table(
        rnn.with_options(unroll=3), step, "1GiB", h0, xs, candidates=(True,)
    )
    kept = eqxscan.remat.fit_remat(
        rnn.with_options(unroll=3), step, "1GiB", h0, xs, candidates=(True,)
    )
    assert kept.unroll == 3 and table.chosen.label == "True"
    with pytest.raises(ValueError, match="unrolls is empty"):
        eqxscan.remat.fit_remat(rnn, step, "1GiB", h0, xs, unrolls=())
    with pytest.raises(ValueError, match=r"unrolls \(1, 2\) needs time_steps > 0"):
        eqxscan.remat.fit_remat(rnn, step, "1GiB", h0, xs, unrolls=(1, 2))
    table = eqxscan.remat.remat_table(  # a single unroll needs no timing
        rnn, step, "1GiB", h0, xs, candidates=(True,), unrolls=(2,)
    )
    one = table.chosen.apply(rnn)
    assert one.unroll == 2 and table.chosen.measured_s is None


def test_every_scan_in_the_model_gets_the_setting(getkey):
    models = _elman_model(getkey())
    x = jax.random.normal(getkey(), (5, 4))
    step = eqx.filter_value_and_grad(_two_part_loss)
    table = eqxscan.remat.remat_table(
        models, step, 2**30, x, candidates=(True, "nested")
    )
    got = eqxscan.remat.fit_remat(models, step, 2**30, x, candidates=(True, "nested"))
    assert got[0].blocks.remat == got[1].remat == table.chosen.remat
    # Shape-only inputs are enough to compile.
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    eqxscan.remat.fit_remat(models, step, 2**30, shape, candidates=(True,))


def test_an_optimizer_state_argument_gets_the_candidates_setting(getkey):
    # The state holds the model's structure (its remat= included): from the
    # second candidate on, the update refused it ("different pytree metadata").
    model = eqxscan.StackedMLP(8, 3, key=getkey())
    tx = optax.adam(1e-3)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    x = jax.random.normal(getkey(), (4, 8))

    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        with jax.numpy_dtype_promotion("standard"):  # optax's step count
            updates, opt_state = tx.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    candidates = (True, False)
    table = eqxscan.remat.remat_table(
        model, step, 2**30, opt_state, x, candidates=candidates
    )
    assert [c.remat for c in table.candidates] == list(candidates)
    fitted = table.chosen.apply(model)
    opt_state = with_remat(opt_state, table.chosen.remat)
    step(fitted, opt_state, x)  # the old state, given the chosen setting


class _RNNLayer(eqx.Module):
    rnn: eqxscan.Recurrent

    def __call__(self, x):
        return self.rnn(x, jnp.stack([x, -x]))[0]


def test_scans_inside_layers_get_the_setting_too(getkey):
    # A layer's own Recurrent, inside a Stacked and a Chain: the candidate's
    # label is what every scan runs, and the values are the loop's.
    cell = lambda k: _RNNLayer(eqxscan.Recurrent(eqxscan.ElmanCell(4, 4, key=k)))
    stack = eqxscan.Stacked(cell, 3, key=getkey())
    chain = eqxscan.Chain([cell(getkey()), eqx.nn.Linear(4, 4, key=getkey())])
    model = with_remat((stack, chain), True)
    assert model[0].layers.rnn.remat is True and model[1][0].rnn.remat is True
    x = jax.random.normal(getkey(), (4,))
    loss = lambda m: jnp.sum(jnp.sin(m[1](m[0](x))))
    loop = (stack.with_options(mode="loop"), chain.with_options(mode="loop"))
    want = eqx.filter_value_and_grad(loss)(loop)
    got = eqx.filter_value_and_grad(loss)(model)
    assert tree_allclose(_arrays(got), _arrays(want), rtol=1e-5)


def test_bad_calls(mlp_problem):
    model, x = mlp_problem
    with pytest.raises(ValueError, match="holds no eqxscan.Stacked"):
        eqxscan.remat.fit_remat(
            eqx.nn.Linear(2, 2, key=jax.random.key(0)), _mse_step, 10
        )
    with pytest.raises(ValueError, match="budget must be"):
        eqxscan.remat.fit_remat(model, _mse_step, "lots", x)
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    with pytest.raises(ValueError, match="must be arrays"):
        eqxscan.remat.fit_remat(
            model, _mse_step, 2**30, shape, candidates=("auto",), time_steps=1
        )
    # A lone setting is not iterated letter by letter (a runtime type checker
    # may say so first), nor a negative count ignored.
    with pytest.raises(TypeError, match="candidates"):
        eqxscan.remat.fit_remat(model, _mse_step, 2**30, shape, candidates="auto")
    with pytest.raises(TypeError, match="unrolls"):
        eqxscan.remat.fit_remat(model, _mse_step, 2**30, shape, unrolls=2)
    # An iterator (read once) is refused too, with a hint that fits it.
    with (
        untyped(),
        pytest.raises(TypeError, match=r"candidates=tuple\(...\) of the generator"),
    ):
        eqxscan.remat.fit_remat(
            model, _mse_step, 2**30, shape, candidates=(c for c in ("auto", True))
        )
    with pytest.raises(ValueError, match="time_steps must be >= 0, got -1"):
        eqxscan.remat.fit_remat(model, _mse_step, 2**30, shape, time_steps=-1)


# Choosing: the fastest fitting candidate, comparing like with like


def _candidate(label, device_bytes, estimated_s, kind="loop", measured_s=None):
    return eqxscan.remat.RematCandidate(
        remat=True,
        label=label,
        temp_bytes=device_bytes,
        argument_bytes=0,
        output_bytes=0,
        host_temp_bytes=0,
        flops=0.0,
        bytes_accessed=0.0,
        estimated_s=estimated_s,
        compiled=jax.jit(jnp.sin).lower(1.0).compile(),
        measured_s=measured_s,
        kind=kind,
    )


def test_choose_picks_the_fastest_fitting_candidate():
    # The fastest fitting one is neither the smallest, the largest, the first
    # nor the last; the fastest of all does not fit.
    cands = [
        _candidate("first", 300, 5.0),
        _candidate("smallest", 100, 4.0),
        _candidate("fastest fitting", 400, 2.0),
        _candidate("too big", 2000, 1.0),
        _candidate("largest fitting", 1000, 3.0),
        _candidate("last", 200, 6.0),
    ]
    assert choose(cands, 1000).label == "fastest fitting"
    assert choose(cands, 399).label == "smallest"
    assert choose(cands, 100).label == "smallest"
    assert choose(cands, 10**9).label == "too big"
    # By measurement, the estimate does not matter.
    timed = [
        dataclasses.replace(c, measured_s=m)
        for c, m in zip(cands, (3.0, 4.0, 5.0, 0.5, 1.0, 6.0), strict=True)
    ]
    assert choose(timed, 1000, measured=True).label == "largest fitting"
    assert choose(timed, 1000).label == "fastest fitting"


def test_choose_compares_estimates_within_a_kind():
    # A loop's figures count its body once, so its estimate is not comparable
    # with an unrolled program's: the unrolled one wins across kinds, the
    # estimate within each; measured times compare all.
    cands = [
        _candidate("loop", 100, 0.5, "loop", measured_s=3.0),
        _candidate("unrolled slow", 200, 2.0, "unrolled", measured_s=2.0),
        _candidate("unrolled fast", 300, 1.0, "unrolled", measured_s=1.0),
    ]
    assert choose(cands, 1000).label == "unrolled fast"
    assert choose(cands, 200).label == "unrolled slow"
    assert choose(cands, 100).label == "loop"
    loop_fastest = [dataclasses.replace(cands[0], measured_s=0.1), *cands[1:]]
    assert choose(loop_fastest, 1000, measured=True).label == "loop"


def test_short_stacks_do_not_pick_the_loop_by_its_body_alone(monkeypatch):
    # At L=6 "auto" unrolls the stack fully (XLA counts all six layers) while
    # "nested" keeps a loop (its body counted once), so nested's raw estimate is
    # the lowest although it recomputes more; it measured 1.19x "auto"'s step on
    # the Transformer bench. The pick is an unrolled program. (The default
    # unrolls these 160 KiB of weights once the copy limit allows it.)
    monkeypatch.setattr(
        _auto, "THRESHOLDS", dataclasses.replace(_auto.THRESHOLDS, unroll_copies=2**30)
    )
    model = eqxscan.StackedMLP(32, 6, key=jax.random.key(0))
    x = jnp.ones((64, 32))
    table = eqxscan.remat.remat_table(model, _mse_step, "1GiB", x)
    by = {c.label: c for c in table.candidates}
    # An explicit remat keeps a loop too (unrolled, XLA recomputed nothing).
    assert {by[k].kind for k in ("'nested'", "True")} == {"loop"}
    assert {by[k].kind for k in ("'auto'", "False")} == {"unrolled"}
    assert min(table.candidates, key=lambda c: c.estimated_s).kind == "loop"
    assert table.chosen.kind == "unrolled"
    unrolled = [c for c in table.candidates if c.kind == "unrolled"]
    assert table.chosen.estimated_s == min(c.estimated_s for c in unrolled)
    assert by["'nested'"].flops < table.chosen.flops  # its body, counted once
    # Only nested fits: nested.
    only = eqxscan.remat.remat_table(
        model, _mse_step, by["'nested'"].device_bytes, x, candidates=("auto", "nested")
    )
    assert only.chosen.label == "'nested'"


def test_bad_peaks_and_timing_arguments_are_named():
    # A zero peak divided by zero; a negative one ranked by negative estimates;
    # calls=0 divided by zero and calls=-1 gave negative times.
    model = eqxscan.StackedMLP(16, 2, key=jax.random.key(0))
    x = jnp.ones((4, 16))
    for peak in (eqxscan.remat.Peak(0.0, 0.0), eqxscan.remat.Peak(-1.0, 1e12)):
        with pytest.raises(ValueError, match=r"peak must be a Peak of pos.*\nHint"):
            eqxscan.remat.remat_table(model, _mse_step, "1GiB", x, peak=peak)
    steps = {"one": lambda: jnp.ones(())}
    for bad in (dict(calls=0), dict(calls=-1), dict(rounds=0)):
        kwargs = dict(rounds=1) | bad
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be >= 1"):
            eqxscan.remat.time_interleaved(steps, **kwargs)
