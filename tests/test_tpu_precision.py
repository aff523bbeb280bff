"""Stacked float32 weights stay float32 on TPU. XLA:TPU's bfloat16 propagation
narrows a float32 value whose only live uses are matmuls; inside `lax.scan`
that value is the whole stack, converted before the loop. So each scanned step
must read its float32 slices by some live use besides a matmul (see
`eqxscan/_scan/f32_pin.py`): checked on the traced program on any backend, and
on a deviceless TPU v5e compile where libtpu is installed."""

import importlib.util

import equinox as eqx
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
import pytest

import eqxscan
from eqxscan._scan.f32_pin import pin


D, L, B = 16, 3, 2
#: Ops through which XLA carries a bfloat16 operand from their output to
#: their input: a use by one counts only if its output has another use.
FORWARDING = {
    "reshape",
    "transpose",
    "squeeze",
    "broadcast_in_dim",
    "copy",
    "copy_p",
    "convert_element_type",
    "expand_dims",
    "name",
    "slice",
    "dynamic_slice",
    "gather",
}


def _sub_jaxpr(eqn: jcore.JaxprEqn) -> jcore.Jaxpr | None:
    for name in ("jaxpr", "call_jaxpr"):
        sub = eqn.params.get(name)
        if isinstance(sub, jcore.ClosedJaxpr):
            return sub.jaxpr
        if isinstance(sub, jcore.Jaxpr):
            return sub
    return None


def float32_uses(jaxpr: jcore.Jaxpr, live_out: list[bool]) -> list[bool]:
    """Per input of `jaxpr`: whether a live use of it (one that reaches an
    output marked in `live_out`) is neither a matmul nor an op forwarding
    its precision to one (inside nested calls, e.g. `jax.checkpoint`)."""
    live: set = {v for v, keep in zip(jaxpr.outvars, live_out) if keep}
    wide: set = set()  # vars with a live use that needs them float32
    for eqn in reversed(jaxpr.eqns):
        outs = [v in live for v in eqn.outvars]
        if not any(outs):
            continue
        sub = _sub_jaxpr(eqn)
        if sub is not None and len(sub.invars) == len(eqn.invars):
            for flag, outer in zip(float32_uses(sub, outs), eqn.invars):
                if _is_var(outer):
                    live.add(outer)
                    if flag:
                        wide.add(outer)
            continue
        name = eqn.primitive.name
        needs = name != "dot_general" and (
            name not in FORWARDING or any(v in wide for v in eqn.outvars)
        )
        for v in eqn.invars:
            if _is_var(v):
                live.add(v)
                if needs:
                    wide.add(v)
    return [v in wide for v in jaxpr.invars]


def _is_var(v: object) -> bool:
    return isinstance(v, jcore.Var)


def scanned_stacks(jaxpr: jcore.Jaxpr) -> list[tuple[jcore.JaxprEqn, list[int]]]:
    """Every `scan` in `jaxpr` (nested calls included) with the positions, in
    its body's inputs, of its float32 scanned inputs of rank 3 or more."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            start = eqn.params["num_consts"] + eqn.params["num_carry"]
            found.append(
                (
                    eqn,
                    [
                        start + n
                        for n, v in enumerate(eqn.invars[start:])
                        if v.aval.dtype == jnp.float32 and v.aval.ndim >= 3
                    ],
                )
            )
        sub = _sub_jaxpr(eqn)
        if sub is not None:
            found += scanned_stacks(sub)
        elif eqn.primitive.name == "scan":
            found += scanned_stacks(eqn.params["jaxpr"].jaxpr)
    return found


def _model(remat: object, dtype=jnp.float32) -> eqxscan.StackedMLP:
    model = eqxscan.StackedMLP(D, L, key=jax.random.key(0), dtype=dtype)
    blocks = model.blocks.with_options(mode="scan", unroll=1, remat=remat)
    return eqx.tree_at(lambda m: m.blocks, model, blocks)


@pytest.mark.parametrize("remat", [False, True, "auto", eqxscan.ScanRemat(nested=1)])
def test_a_decode_step_reads_every_float32_stack_in_float32(remat):
    model = _model(remat)
    x = jnp.ones((B, D))
    jaxpr = eqx.filter_make_jaxpr(lambda m, x: m(x))(model, x)[0].jaxpr
    scans = scanned_stacks(jaxpr)
    assert scans and any(stacks for _, stacks in scans)
    for eqn, stacks in scans:
        body = eqn.params["jaxpr"].jaxpr
        uses = float32_uses(body, [True] * len(body.outvars))
        for n in stacks:
            assert uses[n], (
                f"scanned input {n} ({eqn.invars[n].aval}) is read only by "
                "matmuls: XLA:TPU would convert the whole stack to bfloat16"
            )


def test_the_check_sees_a_stack_read_only_by_matmuls():
    # The unpinned scan the engine used to build: its weights feed matmuls only.
    def step(x, w):
        return jnp.tanh(x @ w[0]) @ w[1], None

    w = jnp.ones((L, 2, D, D))
    jaxpr = jax.make_jaxpr(lambda x, w: jax.lax.scan(step, x, w))(jnp.ones(D), w)
    ((eqn, stacks),) = scanned_stacks(jaxpr.jaxpr)
    body = eqn.params["jaxpr"].jaxpr
    assert stacks and not any(float32_uses(body, [True])[n] for n in stacks)


def test_pin_changes_no_value_gradient_or_tangent():
    w = {"a": jnp.full((2, 3), jnp.nan), "b": jnp.arange(4.0)}
    c = (jnp.array([-0.0, 1.5, jnp.nan]), jnp.int32(3))
    out = pin(w, c)
    np.testing.assert_array_equal(
        np.asarray(out[0]).view(np.uint32), np.asarray(c[0]).view(np.uint32)
    )
    assert out[1] is c[1]
    grad = jax.grad(lambda v: jnp.sum(pin(w, (v, 0))[0] * jnp.arange(3.0)))(c[0])
    np.testing.assert_array_equal(grad, jnp.arange(3.0))
    tangent = jax.jvp(lambda v: pin(w, v), (c[0],), (jnp.ones(3),))[1]
    np.testing.assert_array_equal(tangent, jnp.ones(3))
    batched = jax.vmap(lambda v: pin(w, v))(jnp.ones((2, 3)))
    np.testing.assert_array_equal(batched, jnp.ones((2, 3)))
    # Nothing float32 to read, or no inexact carry: nothing is added.
    ints = {"i": jnp.arange(3)}
    assert pin(ints, c) is c
    only_int = (jnp.int32(1),)
    assert pin(w, only_int)[0] is only_int[0]


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="compiles for a TPU v5e without one: needs libtpu",
)
def test_a_tpu_compile_holds_no_copy_of_a_float32_stack():
    from benchmarks.tpu_compile import decode_step, tpu_target

    facts = decode_step("float32", "scan", B, 4, 256, tpu_target())
    assert facts["copies"] == []  # was two converts to bfloat16[4, ...]
    assert facts["temp"] <= facts["weights"] / 4  # at most one layer's weights


def test_loop_copies_are_told_by_where_they_run():
    # `benchmarks.tpu_compile.loop_copies` reads an optimised HLO text: a copy in
    # a while body runs once an iteration, one in the entry once a step; a copy
    # inside a fusion reads tiles, not a whole array, and is not counted.
    from benchmarks.tpu_compile import loop_copies

    hlo = "\n".join(
        [
            "%fused (p: bf16[4,8]) -> bf16[4,8] {",
            "  %p = bf16[4,8]{1,0} parameter(0)",
            "  ROOT %copy.1 = bf16[4,8]{0,1} copy(%p)",
            "}",
            "%body.3 (t: (s32[], f32[2,3])) -> (s32[], f32[2,3]) {",
            "  %c = f32[2,3]{0,1} copy(%g)",
            "  %f = bf16[4,8]{0,1} fusion(%x), kind=kLoop, calls=%fused",
            "}",
            "ENTRY %main (a: bf16[16,2]) -> bf16[16,2] {",
            "  %w = (s32[], f32[2,3]) while(%t), condition=%cond, body=%body.3",
            "  ROOT %copy.2 = bf16[16,2]{0,1} copy(%a)",
            "}",
        ]
    )
    assert loop_copies(hlo) == {
        "body": [("f32[2,3]", 24)],
        "entry": [("bf16[16,2]", 64)],
    }
