"""The one scan engine behind `Stacked`, `Chain` and `Recurrent`.

It runs `step(carry, x_i) -> (carry, y_i)` over the leading axis of `xs`, either
with `jax.lax.scan` (one traced body) or with a Python loop (the reference path),
applies the requested rematerialisation, and checks the carry contract while the
body is traced, before `lax.scan` or XLA can raise anything less readable.
"""

from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._auto import resolve
from ._checks import check_carry, noted
from ._options import Checkpoint, ScanOptions
from ._remat import CARRY, name_tree, nested_scan, ScanCheckpoint, sqrt_block
from ._stateful import clone


#: The matmul-saving policy: save the outputs of matmuls that have no batch
#: dimensions (the weight products) and recompute the elementwise work (norms,
#: activations, residual adds) in the backward pass. A plain scan stores every
#: elementwise intermediate of every step in stacked buffers, which costs more
#: time and memory than the unrolled loop once they add up. `checkpoint="auto"`
#: picks between saving everything, this policy and full remat from the traced
#: step's shapes (eqxscan/_auto.py; docs/default-checkpoint.md).
AUTO_POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

#: What `checkpoint="offload"` means: the values `AUTO_POLICY` keeps, but in host
#: memory ("pinned_host") rather than on the device; XLA copies them back for the
#: backward pass. Where device and host memory are one (the CPU backend) the
#: placement is a no-op and the program matches `AUTO_POLICY`'s.
OFFLOAD_POLICY = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
    "device", "pinned_host"
)

Step = Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


def remat(fn: Step, checkpoint: Checkpoint, *, in_scan: bool) -> Step:
    """`fn` wrapped in `jax.checkpoint` as `checkpoint` asks (one scan step)."""
    # Inside a scan the loop boundary already stops XLA from CSE-ing the
    # recomputation away, so `prevent_cse=False` avoids needless barriers.
    prevent_cse = not in_scan
    if checkpoint is False:
        return fn
    if checkpoint is True:
        return jax.checkpoint(fn, prevent_cse=prevent_cse)
    policy = OFFLOAD_POLICY if checkpoint == "offload" else checkpoint
    policy = AUTO_POLICY if isinstance(policy, str) else policy
    return jax.checkpoint(fn, policy=policy, prevent_cse=prevent_cse)


def _policy(checkpoint: ScanCheckpoint) -> Callable:
    """The one step policy of a `ScanCheckpoint`: its `policy` for the step's
    internals, its `save_*` options for the named carry and inputs."""
    base = {
        True: jax.checkpoint_policies.nothing_saveable,
        False: jax.checkpoint_policies.everything_saveable,
    }
    inner = checkpoint.policy
    if inner is True or inner is False:
        return checkpoint.step_policy(base[inner])
    return checkpoint.step_policy(AUTO_POLICY if isinstance(inner, str) else inner)


def _named_carry(body: Step) -> Step:
    # The carry a step receives, named so that `ScanCheckpoint` can keep,
    # recompute or offload it.
    return lambda c, x: body(name_tree(c, CARRY), x)


def _unstack(xs: PyTree, length: int) -> list[PyTree]:
    # One `split` per leaf rather than `length` slices: its transpose is a single
    # concatenate, so the loop's gradient does not add up `length` padded copies.
    if length == 1:
        return [jtu.tree_map(lambda a: a[0], xs)]
    leaves, treedef = jtu.tree_flatten(xs)
    pieces = [jax.lax.split(a, [1] * length) for a in leaves]
    return [
        jtu.tree_unflatten(treedef, [p[i][0] for p in pieces]) for i in range(length)
    ]


def _stack(ys: list[PyTree]) -> PyTree:
    # Stack the array leaves; keep the other leaves once, as `lax.scan` does with
    # the static part of its one traced body's output.
    dyn, static = zip(*(eqx.partition(y, eqx.is_array) for y in ys))
    return eqx.combine(jtu.tree_map(lambda *a: jnp.stack(a), *dyn), static[0])


def _flip(tree: PyTree) -> PyTree:
    return jtu.tree_map(lambda a: jnp.flip(a, axis=0), tree)


def run(
    step: Step,
    carry: PyTree,
    xs: PyTree,
    *,
    length: int,
    options: ScanOptions,
    reverse: bool = False,
    where: Callable[[int | None], str] = lambda i: "step" if i is None else f"step {i}",
    gathered: bool = False,
    over: Literal["layers", "time"] = "layers",
) -> tuple[PyTree, PyTree]:
    """Run `step` over the leading axis (of length `length`) of the array pytree `xs`.

    **Arguments:**

    - `step`: `step(carry, x_i) -> (carry, y_i)`. May close over anything.
    - `carry`: any pytree; array leaves are scanned, other leaves must come back
      unchanged.
    - `xs`: a pytree of arrays, each with leading axis `length`.
    - `options`: mode, rematerialisation and unroll.
    - `reverse`: consume `xs` last to first; `ys` stays aligned with `xs`.
    - `where`: names step `i` (or every step, for `None`) in error messages.
    - `gathered`: each step may gather its slice of sharded `xs` (FSDP), so
      `unroll="auto"` keeps the scan: unrolled, XLA may gather every step's at once.
    - `over`: what the steps are, for `unroll="auto"`: `"layers"` (weights in
      `xs`) or `"time"` (a cell's weights closed over).

    **Returns:**

    `(final carry, ys)` with `ys` stacked on axis 0 (`None` if steps return `None`).
    """
    checkpoint, unroll = options.checkpoint, options.unroll
    if options.mode == "loop":
        return _run_loop(step, carry, xs, length, checkpoint, reverse, where)
    c_dyn, c_static = eqx.partition(carry, eqx.is_array)
    y_static_box: list[PyTree] = []

    def body(c_dyn: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
        c = eqx.combine(c_dyn, c_static)
        old = clone(c)  # the step may invalidate `c` (an `eqx.nn.State`)
        new, y = noted(step, where(None), c, x)
        check_carry(old, new, where(None))
        new_dyn, _ = eqx.partition(new, eqx.is_array)
        y_dyn, y_static = eqx.partition(y, eqx.is_array)
        if not y_static_box:
            y_static_box.append(y_static)
        return new_dyn, y_dyn

    checkpoint, unroll = resolve(
        body,
        c_dyn,
        xs,
        length,
        checkpoint,
        unroll,
        AUTO_POLICY,
        where(None),
        gathered,
        over,
    )
    if unroll is True and not (
        isinstance(checkpoint, ScanCheckpoint) or checkpoint == "nested"
    ):
        # Unrolled fully: the loop's own program, and its per-step error messages.
        return _run_loop(step, carry, xs, length, checkpoint, reverse, where)
    if isinstance(checkpoint, ScanCheckpoint):
        levels = checkpoint.levels(length) or ()
        c_dyn, ys = nested_scan(
            _named_carry(body),
            c_dyn,
            xs,
            length,
            levels,
            unroll,
            _policy(checkpoint),
            checkpoint.boundary_policy(),
            reverse,
        )
    elif checkpoint == "nested":
        c_dyn, ys = _nested_scan(body, c_dyn, xs, length, unroll, reverse)
    else:
        c_dyn, ys = jax.lax.scan(
            remat(body, checkpoint, in_scan=True),
            c_dyn,
            xs,
            length=length,
            unroll=unroll,
            reverse=reverse,
        )
    y_static = y_static_box[0] if y_static_box else None
    return eqx.combine(c_dyn, c_static), eqx.combine(ys, y_static)


def _run_loop(
    step: Step,
    carry: PyTree,
    xs: PyTree,
    length: int,
    checkpoint: Checkpoint,
    reverse: bool,
    where: Callable[[int | None], str],
) -> tuple[PyTree, PyTree]:
    # The reference path. "auto" and "nested" are scan-specific optimisations, so
    # the loop saves everything unless remat was asked for explicitly.
    if isinstance(checkpoint, ScanCheckpoint):
        explicit: Checkpoint = _policy(checkpoint)
    elif checkpoint is True or callable(checkpoint) or checkpoint == "offload":
        explicit = checkpoint
    else:
        explicit = False

    def step_fn(c: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
        if explicit is False:
            return step(c, x)
        # jax.checkpoint takes and returns arrays only: close over the rest.
        c_dyn, c_static = eqx.partition(c, eqx.is_array)
        statics: list[PyTree] = []

        def arrays_only(c_dyn: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
            new, y = step(eqx.combine(c_dyn, c_static), x)
            (new_dyn, new_static), (y_dyn, y_static) = (
                eqx.partition(new, eqx.is_array),
                eqx.partition(y, eqx.is_array),
            )
            statics.append((new_static, y_static))
            return new_dyn, y_dyn

        if isinstance(checkpoint, ScanCheckpoint):
            arrays_only = _named_carry(arrays_only)
        new_dyn, y_dyn = remat(arrays_only, explicit, in_scan=False)(c_dyn, x)
        return eqx.combine(new_dyn, statics[0][0]), eqx.combine(y_dyn, statics[0][1])

    ys = [None] * length
    order = range(length - 1, -1, -1) if reverse else range(length)
    slices = _unstack(xs, length) if length > 0 else []
    for current in order:
        old = clone(carry)  # the step may invalidate `carry` (an `eqx.nn.State`)
        new, y = noted(step_fn, where(current), carry, slices[current])
        check_carry(old, new, where(current), current)
        # Kept apart from the next step's carry, which that step may invalidate.
        carry, ys[current] = new, clone(y)
    if length == 0 or all(y is None for y in ys):
        return carry, None
    return carry, _stack(ys)


def _nested_scan(
    body: Step,
    carry: PyTree,
    xs: PyTree,
    length: int,
    unroll: int | bool,
    reverse: bool,
) -> tuple[PyTree, PyTree]:
    """Two-level scan: the outer scan saves one carry per block of about sqrt(L)
    steps; a block's steps are recomputed (with the "auto" policy) during the
    backward pass. Saved carries grow like sqrt(L) rather than L."""
    if reverse:
        carry, ys = _nested_scan(body, carry, _flip(xs), length, unroll, False)
        return carry, _flip(ys)
    inner = sqrt_block(length)
    outer, rest = divmod(length, inner)
    step = remat(body, "auto", in_scan=True)

    def block(c: PyTree, xs_block: PyTree) -> tuple[PyTree, PyTree]:
        return jax.lax.scan(step, c, xs_block, length=inner, unroll=unroll)

    head = jtu.tree_map(
        lambda a: a[: outer * inner].reshape(outer, inner, *a.shape[1:]), xs
    )
    carry, ys = jax.lax.scan(
        jax.checkpoint(block, prevent_cse=False), carry, head, length=outer
    )
    ys = jtu.tree_map(lambda a: a.reshape(outer * inner, *a.shape[2:]), ys)
    if rest:
        tail = jtu.tree_map(lambda a: a[outer * inner :], xs)
        carry, ys_tail = jax.lax.scan(step, carry, tail, length=rest, unroll=unroll)
        ys = jtu.tree_map(lambda a, b: jnp.concatenate([a, b]), ys, ys_tail)
    return carry, ys
