"""Steps that run only where a run bit is set (LayerDrop): a skipped step
passes its carry on and costs next to nothing, forward and backward.

`skip_scan` is a `jax.custom_vjp` around the whole scan whose backward is a
`lax.cond` per step on the same bit: the stacked weights are indexed inside the
running branch and their gradients written into one stacked buffer in place, so
a skipped layer touches none of its weights in either pass. `skip_step` is one
such step on its own (a `Chain`'s lone layer, the loop, a named or nested remat).
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jcore
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, PyTree

from .._helpers import checks
from .layer_io import index, write
from .scan_remat import Policy, Step, Traced


def inexact(value: object) -> bool:
    """Whether `value` is an array that takes a (non-`float0`) cotangent."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _no_cotangent(a: Array) -> np.ndarray:
    """The cotangent of an integer, bool or key array."""
    return np.zeros(jnp.shape(a), jax.dtypes.float0)


def _split(values: Sequence[object]) -> tuple[list[object], list[object], list[bool]]:
    """`(fixed, diff, mask)`: the values without and with cotangents."""
    mask = [inexact(v) for v in values]
    diff = [v for v, d in zip(values, mask) if d]
    fixed = [v for v, d in zip(values, mask) if not d]
    return fixed, diff, mask


def _merge(fixed: Sequence[object], diff: Sequence[object], mask: list[bool]) -> list:
    """Undo `_split`."""
    fixed_, diff_ = iter(fixed), iter(diff)
    return [next(diff_) if d else next(fixed_) for d in mask]


def _zeros(avals: Sequence[jax.core.ShapedArray]) -> list[Array]:
    """Zeros of these types, varying over the same manual axes (`shard_map`) and
    sharded as they are."""
    out = []
    for a in avals:
        # Split over explicit mesh axes as `a` is (a pipeline's data axis).
        sharding = getattr(a, "sharding", None)
        spec = getattr(sharding, "spec", None)
        explicit = spec is not None and any(p is not None for p in spec)
        z = jnp.zeros(a.shape, a.dtype, out_sharding=sharding if explicit else None)
        vma = getattr(getattr(a, "manual_axis_type", None), "varying", ())
        out.append(jax.lax.pcast(z, tuple(sorted(vma)), to="varying") if vma else z)
    return out


def arrays_only(
    fn: Callable[..., tuple[PyTree, PyTree]], c_static: PyTree
) -> tuple[Callable[..., tuple[PyTree, PyTree]], list[tuple[PyTree, PyTree]]]:
    """`fn(carry, *rest) -> (carry, y)` on and to array leaves only (for
    `jax.checkpoint`, `make_jaxpr`), and where each call puts the other leaves."""
    statics: list[tuple[PyTree, PyTree]] = []

    def body(c_dyn: PyTree, *rest: PyTree) -> tuple[PyTree, PyTree]:
        new, y = fn(eqx.combine(c_dyn, c_static), *rest)
        dyn, static = eqx.partition((new, y), eqx.is_array)
        statics.append(static)
        return dyn

    return body, statics


def same_types(old: PyTree, new: PyTree) -> bool:
    """Whether `new` (arrays, or their shapes) is a carry that a skipped layer
    can pass on instead: the structure, shapes and dtypes of `old`."""
    return jtu.tree_structure(new) == jtu.tree_structure(old) and all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jtu.tree_leaves(new), jtu.tree_leaves(old))
    )


def skip_layer(
    fn: Callable[[PyTree], tuple[PyTree, PyTree]], c: PyTree, runs: Bool[Array, ""]
) -> tuple[PyTree, PyTree]:
    """`fn(c) -> (new carry, y)` where `runs`, else `(c, zeros like y)`. An `fn`
    that breaks the carry contract runs unskipped, for the caller to report."""
    c_dyn, c_static = eqx.partition(c, eqx.is_array)
    body, statics = arrays_only(fn, c_static)
    jaxpr, out_shape = jax.make_jaxpr(body, return_shape=True)(c_dyn)
    n_carry = len(jtu.tree_leaves(c_dyn))
    traced = Traced(jaxpr, jtu.tree_structure(out_shape), None, n_carry)
    skips = same_types(c_dyn, out_shape[0])
    out = skip_step(traced)(c_dyn, ((), runs)) if skips else traced(c_dyn, ())
    return eqx.combine(out, statics[0])


def can_skip_scan(traced: jcore.ClosedJaxpr) -> bool:
    """Whether `skip_scan` takes this step: every carry and output inexact."""
    return all(inexact(a) for a in traced.out_avals)


def skip_scan(
    traced: Traced,
    carry: list[Array],
    xs: list[Array],
    runs: Bool[Array, " L"],
    *,
    length: int,
    reverse: bool,
    unroll: int | bool,
    policy: Policy | None = None,
) -> tuple[list[Array], list[Array]]:
    """`(carry, ys)`, flat: `traced` scanned over `xs`, step `i` run only where
    `runs[i]` (a skipped step passes the carry on and outputs zeros).

    A step that runs saves what `policy` (a `jax.checkpoint` policy) keeps of
    its internals, stacked over the steps (zeros for a skipped one); `None`
    saves only the carry (as `remat=True`). Its slice of `xs` is read again,
    never saved."""
    c_fixed, c_diff, c_mask = _split(list(traced.jaxpr.consts))
    x_fixed, x_diff, x_mask = _split(xs)
    scan = _SkipScan(traced, c_mask, x_mask, length, reverse, unroll, policy, [])

    @jax.custom_vjp
    def skipping(runs: Array, fixed: tuple, diff: tuple, carry: list) -> tuple:
        return scan.forward(runs, fixed, diff, carry, save=False)[:2]

    def forward(runs: Array, fixed: tuple, diff: tuple, carry: list) -> tuple:
        carry_out, ys, saved = scan.forward(runs, fixed, diff, carry, save=True)
        return (carry_out, ys), (runs, fixed, diff, saved)

    skipping.defvjp(forward, scan.backward)
    try:
        carry_out, ys = skipping(
            runs, (c_fixed, x_fixed), (c_diff, x_diff), list(carry)
        )
    except TypeError as e:  # JAX's message for a `jvp` here names no cause
        if "forward-mode autodiff" not in str(e):
            raise
        raise TypeError(
            "Forward-mode differentiation (jax.jvp, jacfwd, hessian) of a call "
            "that skips layers (layer_drop=) is not available: the skip is a "
            "custom_vjp.\nHint: call eqx.nn.inference_mode(model) for it, or "
            "differentiate in reverse mode (jax.grad, jacrev); see "
            f"{checks.docs('depth.md')}."
        ) from None
    return list(carry_out), list(ys)


@dataclasses.dataclass(frozen=True)
class _SkipScan:
    """One `skip_scan`, its inputs split into values with cotangents (`diff`)
    and without (`fixed`), each a `(consts, xs)` pair. `layouts` records, while
    the forward is traced, how a running step saved its vjp (its structure and,
    per leaf, the input it is or `None`)."""

    traced: Traced
    c_mask: list[bool]
    x_mask: list[bool]
    length: int
    reverse: bool
    unroll: int | bool
    policy: Policy | None
    layouts: list[tuple[jtu.PyTreeDef, tuple[int | None, ...]] | None]  # pyright: ignore[reportInvalidTypeForm]  # jax's stubs declare PyTreeDef a variable

    def step(
        self, fixed: tuple, fixed_i: list, consts_d: list, c: list, x_d: list
    ) -> list[Array]:
        """Step `i` (`fixed_i`: its fixed slices), to be differentiated in `diff`."""
        consts = _merge(fixed[0], consts_d, self.c_mask)
        jaxpr = jcore.ClosedJaxpr(self.traced.jaxpr.jaxpr, consts)
        return jcore.jaxpr_as_fun(jaxpr)(*c, *_merge(fixed_i, x_d, self.x_mask))

    def linearized(self, i: Array, c: list, fixed: tuple, diff: tuple) -> tuple:
        """Step `i`'s outputs, what its vjp needs that is not an input, and the
        layout to rebuild the vjp from those and the inputs."""
        fixed_i, diff_i = index((fixed[1], diff[1]), i)
        step = functools.partial(self.step, fixed, fixed_i)
        fn = jax.checkpoint(step, policy=self.policy, prevent_cse=False)
        out, vjp_fn = jax.vjp(fn, diff[0], c, diff_i)
        leaves, tree = jtu.tree_flatten(vjp_fn)
        inputs = jtu.tree_leaves((diff[0], c, diff_i))
        first = {id(v): n for n, v in reversed(list(enumerate(inputs)))}
        where = tuple(first.get(id(leaf)) for leaf in leaves)
        saved = [leaf for leaf, w in zip(leaves, where) if w is None]
        return out, saved, (tree, where)

    def saved_types(self, i: Array, c: list, fixed: tuple, diff: tuple) -> list:
        """The types of what a running step saves, its layout put in `layouts`;
        none when a saved value cannot be zero-filled (a key: recomputed)."""
        found: list = []

        def probe(i: Array, c: list, fixed: tuple, diff: tuple) -> list:
            _, saved, layout = self.linearized(i, c, fixed, diff)
            found.append(layout)
            return saved

        # On the values' own types (varying manual axes included).
        types = jtu.tree_map(jax.typeof, (i, c, fixed, diff))
        avals = list(jax.make_jaxpr(probe)(*types).out_avals)
        usable = not any(jnp.issubdtype(a.dtype, jax.dtypes.extended) for a in avals)
        self.layouts.append(found[0] if usable else None)
        return avals if usable else []

    def forward(
        self, runs: Array, fixed: tuple, diff: tuple, carry: list, save: bool
    ) -> tuple[list, list, tuple[list, list]]:
        """The scan, a `cond` per step; with `save`, each step also outputs the
        carry it received and its saved values."""
        n = self.traced.n_carry
        y_avals = self.traced.jaxpr.out_avals[n:]

        def body(c: list, inp: tuple[Array, Array]) -> tuple[list, tuple]:
            i, k = inp
            saved_avals: list = []
            if save and self.policy is not None:
                saved_avals = self.saved_types(i, c, fixed, diff)

            def running(c: list) -> list[Array]:
                if not saved_avals:
                    fixed_i, diff_i = index((fixed[1], diff[1]), i)
                    return self.step(fixed, fixed_i, diff[0], c, diff_i)
                out, saved, _ = self.linearized(i, c, fixed, diff)
                return list(out) + list(saved)

            skipped = lambda c: list(c) + _zeros(y_avals) + _zeros(saved_avals)
            out = jax.lax.cond(k, running, skipped, c)
            new, y = out[:n], out[n : len(out) - len(saved_avals)]
            saved = out[len(out) - len(saved_avals) :]
            return new, (y, (c if save else [], saved))

        steps = (jnp.arange(self.length), runs)
        carry, (ys, saved) = jax.lax.scan(
            body, carry, steps, self.length, self.reverse, self.unroll
        )
        return carry, ys, saved

    def backward(self, res: tuple, cts: tuple[list, list]) -> tuple[object, ...]:
        """The reverse scan: a running step's vjp (rebuilt from its saved values,
        or recomputed) writes its slice's gradient in place."""
        runs, fixed, diff, (carries, saved) = res
        ct_carry, ct_ys = cts
        consts_diff, xs_diff = diff
        layout = self.layouts[-1] if self.layouts else None

        def body(acc: tuple, inp: tuple) -> tuple[tuple, None]:
            i, k, c_i, saved_i, ct_y = inp

            def run(ct: list, g_consts: list, g_xs: list) -> tuple[list, list, list]:
                fixed_i, diff_i = index((fixed[1], xs_diff), i)
                if layout is None:  # recompute the step's forward here
                    fn = functools.partial(self.step, fixed, fixed_i)
                    vjp_fn = jax.vjp(fn, consts_diff, c_i, diff_i)[1]
                else:  # the forward's vjp, from its saved values and the inputs
                    tree, where = layout
                    inputs = jtu.tree_leaves((consts_diff, c_i, diff_i))
                    rest = iter(saved_i)
                    leaves = [next(rest) if w is None else inputs[w] for w in where]
                    vjp_fn = jtu.tree_unflatten(tree, leaves)
                g_c, g_carry, g_x = vjp_fn(list(ct) + list(ct_y))
                g_consts = [a + b for a, b in zip(g_consts, g_c)]
                g_xs = [write(buf, i, g) for buf, g in zip(g_xs, g_x)]
                return g_carry, g_consts, g_xs

            skip = lambda ct, g_consts, g_xs: (list(ct), g_consts, g_xs)
            return jax.lax.cond(k, run, skip, *acc), None

        start = (list(ct_carry), *jtu.tree_map(jnp.zeros_like, diff))
        steps = (jnp.arange(self.length), runs, carries, saved, list(ct_ys))
        (g_carry, g_consts, g_xs), _ = jax.lax.scan(
            body, start, steps, self.length, not self.reverse, self.unroll
        )
        ct_fixed = jtu.tree_map(_no_cotangent, fixed)
        return _no_cotangent(runs), ct_fixed, (g_consts, g_xs), g_carry


def skip_step(traced: Traced) -> Step:
    """`traced` as a step `(carry, (x, runs)) -> (carry, y)` run only where
    `runs`: a `skip_scan` of one step, which saves its inputs and recomputes its
    forward in the backward's running branch (a plain `lax.cond` would save what
    the running branch computes, weights included, zero-filled when skipped)."""
    n = traced.n_carry

    def step(c_dyn: PyTree, inputs: tuple[PyTree, Array]) -> tuple[PyTree, PyTree]:
        x, runs = inputs
        operands = jtu.tree_leaves((c_dyn, x))
        if can_skip_scan(traced.jaxpr):
            xs = [jnp.expand_dims(a, 0) for a in operands[n:]]
            one = jnp.reshape(runs, (1,))
            c, ys = skip_scan(
                traced, operands[:n], xs, one, length=1, reverse=False, unroll=True
            )
            flat = c + [y[0] for y in ys]
        else:
            # An integer carry or output has no cotangent for the backward's
            # `cond` to pass on: the plain `cond` is differentiated instead.
            skip = lambda *ops: [*ops[:n], *_zeros(traced.jaxpr.out_avals[n:])]
            flat = jax.lax.cond(runs, jcore.jaxpr_as_fun(traced.jaxpr), skip, *operands)
        return jtu.tree_unflatten(traced.out_tree, flat)

    return step
