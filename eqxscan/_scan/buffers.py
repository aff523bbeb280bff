"""Per-layer buffers updated in place (KV caches, per-layer recurrent state).

Unlike a [`eqxscan.per_layer`][] argument, the whole stacked buffer travels in
the scan's carry: each step reads its layer's slice and writes back what the
layer returns (rows it writes with `dynamic_update_slice` alone, another new
slice whole, an unchanged one not at all). Inside an enclosing scan a layer's
buffer is a view: its group's stacked array and the indices the enclosing
steps fixed (`prefix`), so that writes land in the one array at every level."""

import warnings
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, ArrayLike, Integer, PyTree

from .._helpers.checks import check_index, describe, docs, first_difference
from .._helpers.stateful import find_arg, get_arg
from .layer_io import Index, index
from .scan_remat import BUFFER_READ, staged


class PerLayer(eqx.Module):
    """An argument sliced along the layer axis: layer `i` receives slice `i` of
    every array leaf. Build it with [`eqxscan.per_layer`][]."""

    tree: PyTree


def per_layer(tree: PyTree) -> PerLayer:
    """Mark `tree` as a per-layer argument of a [`eqxscan.Stacked`][] call.

    Every array leaf must have the layer axis (length `L`) first; layer `i` is
    called with slice `i`. Non-array leaves are passed to every layer unchanged
    (a tree with no array, such as a list of numbers, is refused).
    Use it positionally or as a keyword value, e.g. for a per-layer
    configuration: `stack(x, scale=eqxscan.per_layer(scales))`. A per-layer
    value that layers update (a KV cache) is an [`eqxscan.buffer`][] instead,
    written in place rather than copied into a new output.

    **Arguments:**

    - `tree`: any pytree whose array leaves have shape `(L, ...)`.

    **Returns:**

    A marker wrapping `tree`.
    """
    return PerLayer(tree)


Reads = Literal["auto", "view", "copy"]


class Buffer(eqx.Module):
    """A per-layer buffer of a call, updated in place: build it with
    [`eqxscan.buffer`][]."""

    tree: PyTree
    prefix: tuple[Index, ...] = ()
    reads: Reads = eqx.field(static=True, default="auto")

    def at(self, i: Index) -> "Buffer":
        """The view of step `i` of the scan over this buffer's leading
        (unfixed) axis."""
        return Buffer(self.tree, (*self.prefix, i), self.reads)

    def of(self, tree: PyTree) -> "Buffer":
        """This view of another stacked buffer (the same prefix and reads)."""
        return Buffer(tree, self.prefix, self.reads)

    def read(self) -> PyTree:
        """The slice this view stands for (named for remat, see `BUFFER_READ`)."""
        if not self.prefix:
            return self.tree
        return jtu.tree_map(
            lambda a: checkpoint_name(_read(a, self.prefix, self.reads), BUFFER_READ),
            self.tree,
        )


#: Where a `LayerBuffers` part sits: `(start, size, period, inner)`, as a
#: chain's group (`inner` is a repeated pattern's own layout, else `()`).
Place = tuple[int, int, int, tuple]


class LayerBuffers(eqx.Module):
    """Every layer's buffer of a [`eqxscan.Chain`][], each of its own size, laid
    out as the chain's groups: a lone layer's buffer as it is, a scanned run's
    stacked on a leading axis, a repeated pattern's as one part per group of
    the pattern with the repeat axis in front. Build it with
    [`eqxscan.layer_buffers`][]; `layer(i)` is layer `i`'s buffer."""

    groups: tuple[PyTree, ...]
    layout: tuple[Place, ...] = eqx.field(static=True)
    # Each group's leaves' numbers of axes as built: a batch axis in front
    # (`jax.vmap`'s) is told apart from the layers even at a batch of `L`.
    ndims: tuple[tuple[int, ...], ...] | None = eqx.field(static=True, default=None)

    @property
    def nbytes(self) -> int:
        """The bytes of every layer's buffer: the sum of their own sizes."""
        return sum(a.nbytes for a in jtu.tree_leaves(self.groups))

    def layer(self, i: int) -> PyTree:
        """Layer `i`'s buffer (`None` for a layer without one); negative `i`
        counts from the end."""
        total = sum(place[1] for place in self.layout)
        i = check_index(i, total, "LayerBuffers", "read it outside `jit`.")
        ndims = self.ndims or (None,) * len(self.groups)
        for part, (start, size, period, inner), nd in zip(
            self.groups, self.layout, ndims
        ):
            if not start <= i < start + size:
                continue
            if period == 0:
                _check_lead(part, None, i, nd)
                return part
            _check_lead(part, size // period, i, nd)
            if period == 1:
                return index(part, i - start)
            r, j = divmod(i - start, period)
            return LayerBuffers(index(part, r), inner).layer(j)
        raise AssertionError(f"the layout of {total} layers does not cover layer {i}")


def _check_lead(
    part: PyTree, n: int | None, i: int, ndims: tuple[int, ...] | None
) -> None:
    # A part's leading axis is its layers (or repeats), `n` of them (a lone
    # layer's part has none): a batch axis in front would silently index the
    # batch instead, or come back with the layer's buffer.
    leaves = jtu.tree_leaves_with_path(part)
    for (path, a), nd in zip(leaves, ndims or (None,) * len(leaves)):
        lead = n is not None and (a.ndim == 0 or a.shape[0] != n)
        if lead or nd not in (None, a.ndim):
            built = f" of {nd} axes" if nd not in (None, a.ndim) else ""
            first = (
                "as a lone layer's buffer"
                if n is None
                else f"with the group's {n} layers (or repeats) first"
            )
            raise ValueError(
                f"LayerBuffers.layer({i}): leaf `{jtu.keystr(path)}` of its group "
                f"is {describe(a)}, but it was built{built} {first}.\nHint: for "
                "batched buffers pick the "
                f"sequence first: `jax.tree.map(lambda a: a[b], buffers).layer({i})` "
                f"({docs('decoding.md')})."
            )


def buffer(tree: PyTree, *, reads: Reads = "auto") -> Buffer:
    """Mark `tree` as a per-layer buffer of a call, updated in place.

    Layer `i` is called with slice `i` of every leaf where the marked argument
    was, and returns its new slice beside its carry: `layer(x, cache, ...) ->
    (x, cache)`. The call then returns `(x, buffer)` with every layer's slice
    written back (`stack.scan` layers return `((x, cache), y)`, and the call
    `((x, buffer), ys)`). Under `jax.jit` with the buffer donated, the update is
    in place: no copy of the whole buffer exists at any time, and a layer that
    writes rows with `jax.lax.dynamic_update_slice` writes only those rows.

    **Arguments:**

    - `tree`: for a [`eqxscan.Stacked`][], a pytree of arrays with the layer
      axis first; for a [`eqxscan.Chain`][], what
      [`eqxscan.layer_buffers`][] builds (each layer's buffer of its own size).
    - `reads`: how a layer reads its slice of a scanned buffer. `"view"` reads
      it from the stacked buffer (XLA fuses the slicing into its readers).
      `"copy"` copies the (updated) slice out once per step (one slice of temp
      memory): on CPU a slice the layer transposes (token-major keys in
      attention) reads about twice as fast, as XLA:CPU transposes a separate
      array with a tiled kernel but a fused slice element by element. `"auto"`
      (default) is `"copy"` on CPU, `"view"` elsewhere.

    **Returns:**

    A marker wrapping `tree`.
    """
    marked = _marked(tree, (Buffer, PerLayer))
    if marked is not None:
        raise TypeError(
            f"eqxscan.buffer got a tree holding an {marked} marker; mark "
            "the arrays once.\nHint: pass the stacked arrays themselves: "
            f"`eqxscan.buffer(cache)` ({docs('decoding.md')})."
        )
    bad = [a for a in jtu.tree_leaves(tree) if not eqx.is_array(a)]
    if bad:
        raise TypeError(
            f"eqxscan.buffer takes a pytree of arrays, but it holds {describe(bad[0])}."
            "\nHint: pass the arrays a layer updates; broadcast anything else."
        )
    if reads not in ("auto", "view", "copy"):
        raise ValueError(
            f"eqxscan.buffer got reads={reads!r}; expected 'auto', 'view' or 'copy'."
            "\nHint: 'auto' reads a copy on CPU and the stacked buffer elsewhere."
        )
    # XLA:TPU tiles the two minor axes by (8, 128); another last axis gets another
    # layout, and a scanned step copies the whole buffer to row-major and back
    # (on a v5e: 1541 MiB of temp, 3x the loop's step for 4 heads of 64).
    leaves = jtu.tree_leaves(tree) if jax.default_backend() == "tpu" else []
    wide = [a for a in leaves if a.ndim >= 3 and a.shape[-1] % 128]
    if wide:
        warnings.warn(
            f"eqxscan.buffer: a leaf of shape {list(wide[0].shape)} has a last axis "
            "that is not a multiple of 128; on a TPU a scanned step copies such a "
            "buffer whole, in and out of the loop.\nHint: store a cache "
            "[.., T, H, E] as [.., T, H * E] and reshape the slice in the layer "
            f"({docs('decoding.md#on-a-tpu')}).",
            stacklevel=2,
        )
    return Buffer(tree, (), reads)


def _marked(tree: PyTree, kinds: tuple[type, ...]) -> str | None:
    # The first marker of `kinds` inside `tree`, named, or `None`.
    for v in jtu.tree_leaves(tree, is_leaf=lambda v: isinstance(v, kinds)):
        if isinstance(v, kinds):
            return "eqxscan." + ("buffer" if isinstance(v, Buffer) else "per_layer")
    return None


def find_buffer(args: tuple, kwargs: dict[str, object]) -> int | str | None:
    """Where the [`eqxscan.buffer`][] argument of a call is (its position or
    name), or `None`."""
    at = find_arg(
        args,
        kwargs,
        Buffer,
        "A call has {} eqxscan.buffer arguments; pass one buffer (any pytree, "
        "e.g. a tuple of keys and values).",
    )
    # One inside another argument would reach each layer whole, unsliced.
    for where, a in (*enumerate(args), *kwargs.items()):
        if where != at and _marked(a, (Buffer,)) is not None:
            arg = repr(where)
            if isinstance(where, int):
                arg = f"its argument {where + 1} after x"
            raise TypeError(
                f"A call has an eqxscan.buffer inside {arg}.\nHint: pass the "
                "buffer as an argument of its own; each layer gets its slice "
                f"there ({docs('decoding.md')})."
            )
    return at


def view_of(args: tuple, kwargs: dict[str, object], at: int | str) -> "Buffer":
    view = get_arg(args, kwargs, at)
    assert isinstance(view, Buffer)
    return view


def refuse_buffer(
    args: tuple, kwargs: dict[str, object], who: str, hint: str = ""
) -> None:
    """Raise if a call that cannot update buffers in place was given one
    (`hint`: what to do instead, if not to call the model itself)."""
    if find_buffer(args, kwargs) is not None:
        hint = hint or "call the model itself, which returns (x, buffer)"
        raise TypeError(f"{who} does not take an eqxscan.buffer.\nHint: {hint}.")


def check_keeps_writes(who: str, drops: bool) -> None:
    """Raise if layers called with a buffer may be dropped (`drops`: drop-path or
    LayerDrop on): a dropped layer would skip its write to the buffer."""
    if drops:
        raise TypeError(
            f"{who} is called with an eqxscan.buffer and with drop_path or "
            "layer_drop, which would skip a dropped layer's write to the buffer."
            "\nHint: decode in inference mode (`eqx.nn.inference_mode(model)`), "
            "where nothing is dropped."
        )


def check_buffer_axis(view: Buffer, length: int, who: str) -> None:
    """Raise unless every leaf of `view`'s buffer has the layer axis (of
    `length`) after the axes its prefix fixes."""
    if isinstance(view.tree, LayerBuffers):
        raise TypeError(
            f"{who} got LayerBuffers, which lay out a Chain's buffers.\nHint: "
            "for a Stacked, build them with eqxscan.layer_buffers(stack, make), or "
            f"stack each layer's buffer on a new leading axis ({docs('decoding.md')})."
        )
    p = len(view.prefix)
    for path, a in jtu.tree_leaves_with_path(view.tree):
        if a.ndim <= p or a.shape[p] != length:
            raise ValueError(
                f"{who} has {length} layers, but buffer leaf "
                f"`buffer{jtu.keystr(path)}` is {describe(a)}: its "
                f"{'first' if p == 0 else f'axis {p}'} axis is not the layer "
                f"axis.\nHint: stack each layer's buffer on a new leading axis, "
                "or build it with eqxscan.layer_buffers."
            )


def _read(a: Array, prefix: tuple[Index, ...], reads: Reads) -> Array:
    # A step's slice of a stacked leaf, as `reads` says. Only a conditional's
    # result keeps a dynamic slice from being fused into its readers: XLA does
    # not know the predicate (the index is never negative), so the slice is
    # copied once, contiguously, and the zeros branch never runs.
    if reads == "auto":
        reads = "copy" if jax.default_backend() == "cpu" else "view"
    # Eagerly (a loop-mode call outside jit) nothing fuses, and a `cond` of
    # fresh branches would be a new program, kept, at every call.
    if reads == "view" or all(isinstance(i, int) for i in prefix) or not staged():
        return index(a, prefix)
    return jax.lax.cond(
        jnp.asarray(prefix[-1]) >= 0,
        lambda a: index(a, prefix),
        lambda a: jnp.zeros(a.shape[len(prefix) :], a.dtype),
        a,
    )


def _write(
    a: Array, prefix: tuple[Index, ...], new: Array, start: tuple | None = None
) -> Array:
    # The stacked leaf `a` with what a layer wrote into the slice at `prefix`:
    # rows `new` at `start`, or its whole new slice (`start=None`).
    if not prefix and start is None:
        return new
    rest = start if start is not None else (0,) * new.ndim
    at = [_int32(i) for i in (*prefix, *rest)]
    # The primitive's starts: a negative one was normalised by the layer's own
    # call, and the primitive clamps it to 0, as the unstacked write does.
    return jax.lax.dynamic_update_slice(
        a, new.reshape((1,) * len(prefix) + new.shape), at, allow_negative_indices=False
    )


def _int32(i: int | Integer[ArrayLike, ""]) -> Array:
    # A start as int32, clamped first: a uint32 (or int64) past 2**31 wrapped
    # negative and was written at row 0, where the primitive clamps it to the end.
    i = jnp.asarray(i)
    if i.dtype != jnp.int32 and jnp.issubdtype(i.dtype, jnp.integer):
        bound = jnp.iinfo(jnp.int32)
        low = max(int(jnp.iinfo(i.dtype).min), int(bound.min))
        high = min(int(jnp.iinfo(i.dtype).max), int(bound.max))
        i = jnp.clip(i, i.dtype.type(low), i.dtype.type(high))
    return i.astype(jnp.int32)


def call_writing(
    fn: Callable[[PyTree], tuple[PyTree, PyTree]], view: Buffer, who: str
) -> tuple[PyTree, PyTree]:
    """`(out, tree)`: `out` of `fn(old) -> (out, new)` on `view`'s slice `old`,
    and the stacked buffer with `new` written. `fn`'s jaxpr is evaluated
    equation by equation, each write going straight into the stacked buffer and
    read back from there, so that XLA updates the buffer in place."""
    old = view.read()
    leaves, treedef = jtu.tree_flatten(old)

    def flat(*ls: Array) -> tuple[tuple[Array, ...], PyTree]:
        out, new = fn(jtu.tree_unflatten(treedef, ls))
        diff = first_difference(old, new)  # laid out as the slice it received
        if diff is not None and jtu.tree_leaves((old, new)):
            path, a, b = diff
            raise TypeError(
                f"{who} returned a buffer of another structure, shape or dtype: "
                f"`buffer{path}` is {b}, but it received {a}.\nHint: a layer's "
                "buffer keeps its shape and dtype, laid out as it came (cast "
                "before writing)."
            )
        return tuple(jtu.tree_leaves(new)), out

    closed, out_dyn, out_static = eqx.filter_make_jaxpr(flat)(*leaves)
    jaxpr = closed.jaxpr
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    rows_of: dict[int, int] = {}  # id of a row-writing equation -> its leaf
    whole_of: dict[jcore.Var, list[int]] = {}  # a new slice made here -> its leaves
    rest: list[int] = []  # slices no equation made (an input, a constant): whole
    for k, var in enumerate(jaxpr.outvars[: len(leaves)]):
        eqn = made.get(var) if isinstance(var, jcore.Var) else None
        if eqn is None:
            if var is not jaxpr.invars[k]:  # else returned unchanged
                rest.append(k)
        elif (
            eqn.primitive is jax.lax.dynamic_update_slice_p
            and eqn.invars[0] is jaxpr.invars[k]
        ):
            rows_of[id(eqn)] = k
        else:
            whole_of.setdefault(var, []).append(k)
    stacked = jtu.tree_leaves(view.tree)
    env = dict(zip(jaxpr.constvars + jaxpr.invars, closed.consts + leaves))

    def value(v: object) -> object:
        return v.val if isinstance(v, jcore.Literal) else env[v]  # pyright: ignore[reportArgumentType]  # a Var

    for eqn in jaxpr.eqns:
        k = rows_of.get(id(eqn))
        if k is not None:
            rows, *start = (value(v) for v in eqn.invars[1:])
            stacked[k] = _write(stacked[k], view.prefix, rows, tuple(start))  # pyright: ignore[reportArgumentType]  # arrays
            env[eqn.outvars[0]] = _read(stacked[k], view.prefix, view.reads)
        else:
            env.update(zip(eqn.outvars, _bind(eqn, [value(v) for v in eqn.invars])))
        # A new whole slice: written as soon as it is made, read back like rows.
        for v in eqn.outvars:
            for k in whole_of.get(v, ()):
                stacked[k] = _write(stacked[k], view.prefix, env[v])  # pyright: ignore[reportArgumentType]  # an array
            if v in whole_of:
                env[v] = _read(stacked[whole_of[v][0]], view.prefix, view.reads)
    results = [value(v) for v in jaxpr.outvars]
    for k in rest:
        stacked[k] = _write(stacked[k], view.prefix, results[k])  # pyright: ignore[reportArgumentType]  # an array
    # What is left are `out`'s arrays: put them back in the whole output.
    full = [None] * len(leaves) + results[len(leaves) :]
    _, out = eqx.combine(
        jtu.tree_unflatten(jtu.tree_structure(out_dyn), full), out_static
    )
    return out, jtu.tree_unflatten(jtu.tree_structure(view.tree), stacked)


def _bind(eqn: jcore.JaxprEqn, args: list[object]) -> list[object]:
    # What `jax.core.eval_jaxpr` does for one equation, its results as a list
    # (older jax returned `(subfuns, params)` from `get_bind_params`).
    bound = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = bound if isinstance(bound, tuple) else ((), bound)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *args, **params)
    return out if eqn.primitive.multiple_results else [out]
