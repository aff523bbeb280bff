"""Rematerialisation (`ScanRemat`): nested remat shapes, saving or
offloading carries and inputs, and rematerialisation over time."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.ad_checkpoint import Offloadable

import eqxscan

from .helpers import (
    Block,
    D,
    elman,
    HID,
    IN,
    L,
    make_stack,
    MemoryCell,
    MODES,
    tree_allclose,
    value_and_grads,
)


# ---- nested remat shapes


@pytest.mark.parametrize(
    "nested, outer_carries", [(2, 2), (3, 3), ((2, 2, 3), 2), ((3, 4), 3)]
)
def test_nested_shapes(nested, outer_carries, getkey):
    layers = 12
    stack = eqxscan.Stacked(lambda k: Block(k), layers, key=getkey())
    x = jr.normal(getkey(), (D,))
    policy = eqxscan.ScanRemat(nested=nested)
    loss = lambda s, x: jnp.sum(jnp.sin(s(x)))
    want = arrays(jax.value_and_grad(loss, argnums=(0, 1))(stack, x))
    for mode in MODES:
        s = stack.with_options(remat=policy, mode=mode)
        got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
        assert tree_allclose(got, want, rtol=1e-4), (mode, nested)
    # Only the carries at the outermost block boundaries are kept; inner levels
    # are recomputed block by block.
    shapes = residual_shapes(loss, stack.with_options(remat=policy), x)
    assert (outer_carries, D) in shapes and (layers, D) not in shapes, shapes


def test_nested_blocks_divide_the_layers_when_they_can(getkey):
    # 14 layers: 2 blocks of 7 (a divisor near sqrt(14)), not 3 blocks of 4 and
    # a remainder of 2, whose split copies the stacked weights.
    stack = eqxscan.Stacked(lambda k: Block(k), 14, key=getkey(), remat="nested")
    loss = lambda s, x: jnp.sum(jnp.sin(s(x)))
    shapes = residual_shapes(loss, stack, jr.normal(getkey(), (D,)))
    assert (2, D) in shapes and (2, 7, D, D) in shapes, shapes


def arrays(tree):
    """The array leaves only: the gradients of two stacks differ in options."""
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def residual_shapes(fn, *args):
    from jax._src.ad_checkpoint import saved_residuals

    return [tuple(aval.shape) for aval, _ in saved_residuals(fn, *args)]


def test_nested_errors(getkey):
    stack = make_stack(getkey)
    # The scan named (in a Chain, the failing one may be a stack in a layer).
    where = r"^The stacked layer Block .*: ScanRemat\(nested=\(2, 3\)\) has 6 .*has 4"
    for mode in MODES:  # the loop, the reference, refuses what the scan does
        nested = eqxscan.ScanRemat(nested=(2, 3))
        with pytest.raises(ValueError, match=where):
            stack.with_options(remat=nested, mode=mode)(jnp.ones(D))
    # A Chain's scanned groups differ in length: the hint says what fits all.
    layers = [Block(getkey()), eqx.nn.Linear(D, D, key=getkey())] * 3
    chain = eqxscan.Chain(layers, remat=eqxscan.ScanRemat(nested=(2, 2)))
    with pytest.raises(ValueError, match=r"(?s)has 3.*Chain.*nested=k"):
        chain(jnp.ones(D))
    with pytest.raises(ValueError, match="two or more positive int lengths"):
        eqxscan.ScanRemat(nested=(4,))
    with pytest.raises(ValueError, match="block count must be >= 1"):
        eqxscan.ScanRemat(nested=0)
    # A bool as no count; NumPy's bool as Python's; the class uncalled named.
    with pytest.raises(TypeError, match=r"got the bool \(True\)"):
        eqxscan.ScanRemat(nested=True)
    assert stack.with_options(remat=np.bool_(True)).options.remat is True
    with pytest.raises(TypeError, match=r"remat=ScanRemat, a class.*\nHint: pass an"):
        stack.with_options(remat=eqxscan.ScanRemat)


def test_nested_without_naming_still_nests(getkey):
    # save_carries=None and save_inputs=None leave the policy to decide, but the
    # nesting asked for is still done (and checked), and reported as given.
    stack = eqxscan.Stacked(lambda k: Block(k), 6, key=getkey())
    x = jr.normal(getkey(), (D,))
    loss = lambda s, x: jnp.sum(jnp.sin(s(x)))
    policy = eqxscan.ScanRemat(save_carries=None, save_inputs=None, nested=(2, 3))
    s = stack.with_options(remat=policy)
    want = arrays(jax.value_and_grad(loss, argnums=(0, 1))(stack, x))
    assert tree_allclose(arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x)), want)
    shapes = residual_shapes(loss, s, x)
    assert (2, D) in shapes and (6, D) not in shapes, shapes
    (choice,) = eqxscan.explain_auto(s, x)
    assert choice.remat is policy and choice.rule.remat == "given"
    bad = eqxscan.ScanRemat(save_carries=None, save_inputs=None, nested=(2, 4))
    with pytest.raises(ValueError, match=r"nested=\(2, 4\)\) has 8 steps.*has 6"):
        stack.with_options(remat=bad)(x)


# ---- carries and inputs: save / offload


def test_an_explicit_remat_on_a_short_stack_saves_memory(getkey):
    # `unroll="auto"` unrolled a 4-layer stack whatever the remat; unrolled,
    # XLA:CPU recomputed nothing, so `remat=True` held more temp than `False`.
    class Wide(eqx.Module):
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jr.split(key)
            self.up, self.down = (
                eqx.nn.Linear(8, 32, key=k1),
                eqx.nn.Linear(32, 8, key=k2),
            )

        def __call__(self, x):
            return jax.vmap(lambda v: v + self.down(jax.nn.gelu(self.up(v))))(x)

    stack = eqxscan.Stacked(Wide, 4, key=getkey())
    x = jr.normal(getkey(), (2048, 8))
    dyn, static = eqx.partition(stack, eqx.is_array)

    def temp(**options):
        s = lambda d: eqx.combine(d, static).with_options(**options)  # noqa: E731
        grad = jax.grad(lambda d, x: jnp.mean(jnp.tanh(s(d)(x)) ** 2))
        return (
            jax.jit(grad).lower(dyn, x).compile().memory_analysis().temp_size_in_bytes
        )

    kept = temp(remat=True)
    assert kept == temp(remat=True, unroll=1)
    assert kept < temp(remat=False) / 2


def test_checkpoint_carries_and_inputs(getkey):
    stack = make_stack(getkey)
    x = jr.normal(getkey(), (D,))
    loss = lambda s, x: jnp.sum(jnp.sin(s(x)))
    want = arrays(jax.value_and_grad(loss, argnums=(0, 1))(stack, x))

    def run(**options):
        policy = eqxscan.ScanRemat(**options)
        s = stack.with_options(remat=policy)
        got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
        assert tree_allclose(got, want, rtol=1e-4), options
        from jax._src.ad_checkpoint import saved_residuals

        return [(aval.str_short(), src) for aval, src in saved_residuals(loss, s, x)]

    def made(residuals, shape):
        # Residuals the forward pass made (not the arguments), of one type.
        return [src for a, src in residuals if a == shape and "argument" not in src]

    carries, weights = f"float32[{L},{D}]", f"float32[{L},{D},{D}]"
    full = run(policy=True)  # full remat still keeps each step's carry
    assert made(full, carries) and not made(full, weights), full
    offloaded = run(policy=True, save_carries="offload")
    assert made(offloaded, f"float32<host>[{L},{D}]"), offloaded
    assert not made(offloaded, carries), offloaded
    # Inputs: by default read again from the stacked weights; saved, a copy of
    # each layer as the step used it (after an FSDP gather); or offloaded.
    assert made(run(policy=True, save_inputs=True), weights)
    offloaded = run(policy=True, save_inputs="offload")
    assert made(offloaded, f"float32<host>[{L},{D},{D}]"), offloaded
    # Recomputed carries: only those at the block boundaries (2 blocks of 2).
    recomputed = run(save_carries=False)
    assert not made(recomputed, carries), recomputed
    assert made(recomputed, f"float32[2,{D}]"), recomputed
    # Nested and offloaded: the block-boundary carries go to the host.
    offloaded = run(nested=2, save_carries="offload")
    assert made(offloaded, f"float32<host>[2,{D}]"), offloaded
    assert not made(offloaded, f"float32[2,{D}]"), offloaded
    # Combined with any jax policy, and with mode="loop".
    run(policy=jax.checkpoint_policies.dots_saveable, save_carries="offload")
    s = stack.with_options(remat=eqxscan.ScanRemat(save_carries="offload"), mode="loop")
    got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
    assert tree_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_offloading_outside_jit_on_an_accelerator_keeps_residuals_on_device(
    mode, getkey, monkeypatch
):
    # Outside jit, a gradient's backward pass runs as programs of its own, and
    # offloaded residuals would pass between them: on a TPU v5e an eager
    # gradient read such copies wrong. There they stay in device memory, with a
    # warning; under jit (one program) and on CPU they are offloaded.
    from eqxscan._scan import scan_remat

    stack = make_stack(getkey, mode=mode)
    x = jr.normal(getkey(), (D,))
    loss = lambda s, x: jnp.sum(jnp.sin(s(x)))
    want = arrays(jax.value_and_grad(loss, argnums=(0, 1))(stack, x))
    dot = jax.core.ShapedArray((D, D), jnp.float32)
    dot_params = dict(dimension_numbers=(((1,), (0,)), ((), ())))
    offloading = [
        eqxscan.ScanRemat(policy=True, save_inputs="offload"),
        eqxscan.ScanRemat(policy=True, save_carries="offload"),
        eqxscan.ScanRemat(nested=2, save_carries="offload"),
        "offload",
        # A user's own offloading policy.
        jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    ]
    for accelerator in (False, True):
        monkeypatch.setattr(scan_remat, "on_accelerator", lambda a=accelerator: a)
        for remat in offloading:
            s = stack.with_options(remat=remat)
            before = scan_remat.as_scan_remat(remat)
            staged = []  # under jit: one program, so offloaded as asked

            def inside_jit(before=before, staged=staged):
                staged.append(scan_remat.kept_on_device(before) is before)
                return jnp.zeros(())

            jax.jit(inside_jit)()
            assert staged == [True], remat
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                jitted = eqx.filter_jit(jax.value_and_grad(loss, argnums=(0, 1)))
                assert tree_allclose(arrays(jitted(s, x)), want, rtol=1e-4), remat
                if not accelerator:  # on CPU, offloaded eagerly too
                    got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
                    assert tree_allclose(got, want, rtol=1e-4), remat
                    assert scan_remat.kept_on_device(before) is before
                    continue
            with warnings.catch_warnings():  # a call without a gradient saves
                warnings.simplefilter("error")  # nothing: no warning
                assert tree_allclose(s(x), stack(x), rtol=1e-5)
                xs = jnp.stack([x, 2 * x])
                assert tree_allclose(jax.vmap(s)(xs), jax.vmap(stack)(xs), rtol=1e-5)
            with pytest.warns(UserWarning, match=r"outside jax.jit on .*device memory"):
                got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
            assert tree_allclose(got, want, rtol=1e-4), remat
            with pytest.warns(UserWarning, match="eqx.filter_jit"):
                on_device = scan_remat.kept_on_device(before)
                on_device.step_policy()(jax.lax.dot_general_p, dot, dot, **dot_params)
            assert "offload" not in (on_device.save_carries, on_device.save_inputs)
            answer = on_device.step_policy()(
                jax.lax.dot_general_p, dot, dot, **dot_params
            )
            assert not isinstance(answer, Offloadable), remat
    # A policy that never offloads is not warned of.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = stack.with_options(remat=jax.checkpoint_policies.dots_saveable)
        got = arrays(jax.value_and_grad(loss, argnums=(0, 1))(s, x))
    assert tree_allclose(got, want, rtol=1e-4)


def test_checkpoint_policy_errors(getkey):
    # (A runtime type checker may catch these first, by the annotations.)
    with pytest.raises((TypeError, ValueError), match=r"save_carries"):
        eqxscan.ScanRemat(save_carries="host")
    with pytest.raises((TypeError, ValueError), match=r"policy"):
        eqxscan.ScanRemat(policy="nested")
    with pytest.raises((TypeError, ValueError), match="remat"):
        make_stack(getkey, remat="everything")
    # A policy factory not called answers with a policy, which JAX would only
    # reject under grad ("unexpected keyword argument 'out_dtype'").
    factory = jax.checkpoint_policies.save_only_these_names
    with pytest.raises(TypeError, match=r"(?s)remat=.*save_only_these_names.*call a"):
        make_stack(getkey, remat=factory)
    with pytest.raises(TypeError, match=r"ScanRemat: policy=.*save_only_these_"):
        eqxscan.ScanRemat(policy=factory)
    with pytest.raises(TypeError, match=r"ScanRemat: policy=.*len.*raised"):
        eqxscan.ScanRemat(policy=len)


@pytest.mark.parametrize("mode", MODES)
def test_scan_checkpoint_over_time(mode, getkey):
    cell = MemoryCell(elman(getkey()))
    h0, xs = jr.normal(getkey(), (HID,)), jr.normal(getkey(), (6, IN))
    memory = jr.normal(getkey(), (HID, HID))

    def run(remat, reverse):
        rnn = eqxscan.Recurrent(cell, mode=mode, remat=remat, reverse=reverse)
        return value_and_grads(
            lambda h, m: rnn(h, xs, m, cell_kwargs={"scale": 0.5}), h0, memory
        )

    for reverse in (False, True):
        want = run(False, reverse)
        for policy in (
            eqxscan.ScanRemat(nested=(2, 3), save_carries="offload"),
            eqxscan.ScanRemat(nested=4, save_inputs=True),
        ):
            assert tree_allclose(run(policy, reverse), want, rtol=1e-4), policy
