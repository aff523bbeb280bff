"""The base classes of cells whose recurrence is linear in the carry, which
[`eqxscan.Recurrent`][] can run in parallel over time as well as step by step."""

import abc
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Inexact, PyTree

from .linear_diag import check_gate_fits


def check_gates_tuple(cell: object, gates: object, n: int) -> tuple:
    """`cell.gates`' result, refused unless a tuple (or list) of `n` gates (an
    array would be unpacked along its first axis: time, in the parallel forms)."""
    if isinstance(gates, tuple | list) and len(gates) == n:
        return tuple(gates)
    names = "(a_t, b_t)" if n == 2 else "(a_t, k_t, v_t, q_t)"
    got = f"a {type(gates).__name__}"
    if isinstance(gates, tuple | list):
        got += f" of {len(gates)}"
    elif hasattr(gates, "shape"):
        got = f"an array of shape {list(gates.shape)}"  # pyright: ignore
    raise TypeError(
        f"{type(cell).__name__}.gates returned {got}, where a tuple {names} was "
        f"expected.\nHint: return the {n} gates as a tuple, not stacked."
    )


class DiagonalLinearCell(eqx.Module):
    """A cell with the diagonal linear recurrence `h_t = a_t * h_{t-1} + b_t`,
    where `a_t` and `b_t` depend on the input `x_t` only (LRU, minGRU, S4D/S5,
    RG-LRU).

    A subclass defines `gates(x_t) -> (a_t, b_t)`, arrays (or pytrees of arrays)
    with the carry's structure and shapes, complex allowed. `__call__` is the
    step `a_t * h + b_t`, so the cell is an ordinary cell: for one-step decoding
    and for `Recurrent(cell, method="sequential")`. The other methods of
    [`eqxscan.Recurrent`][] compute every step's gates at once and run the
    recurrence with `jax.lax.associative_scan` or in chunks (see
    docs/recurrent.md#linear-recurrences).

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan


        class Decay(eqxscan.DiagonalLinearCell):
            rate: jax.Array

            def gates(self, x):
                return jax.nn.sigmoid(self.rate) * jnp.ones_like(x), x


        cell = Decay(jnp.zeros(4))
        xs = jnp.ones((10, 4))
        h_T, hs = eqxscan.Recurrent(cell, method="associative")(jnp.zeros(4), xs)
        h = jnp.zeros(4)
        for x in xs:
            h = cell(x, h)  # h = 0.5 * h + x
        assert jnp.allclose(h_T, h)
        ```
    """

    # A subclass overriding `__call__` without changing the step (a check, a
    # docstring) sets it: the parallel forms then compute its steps from the
    # gates, which they otherwise leave to the cell, step by step.
    parallel_safe: ClassVar[bool] = False

    @abc.abstractmethod
    def gates(self, x_t: PyTree) -> tuple[PyTree, PyTree]:
        """**Arguments:**

        - `x_t`: one time step's input (and any positional arguments and
          `cell_kwargs` the `Recurrent` call passes on, as for other cells).

        **Returns:**

        `(a_t, b_t)`, each with the carry's structure, shapes and dtypes (`a_t`
        may be real where the carry is complex).
        """

    def __call__(
        self, x_t: PyTree, h: PyTree, *args: PyTree, **kwargs: PyTree
    ) -> PyTree:
        """One step, `a_t * h + b_t` (the recurrent form, for decoding).

        **Arguments:**

        - `x_t`: the input at this time step.
        - `h`: the previous carry.
        - `*args`, `**kwargs`: passed on to `gates`.

        **Returns:**

        The next carry.
        """
        a, b = check_gates_tuple(self, self.gates(x_t, *args, **kwargs), 2)
        name = type(self).__name__

        def step(path: tuple, a_: Array, b_: Array, h_: Array) -> Array:
            for what, g in (("a", a_), ("b", b_)):
                check_gate_fits(g, h_, f"{what}{jtu.keystr(path)} from {name}.gates")
            return (a_.astype(h_.dtype) * h_ + b_).astype(h_.dtype)

        return jtu.tree_map_with_path(step, a, b, h)


class MatrixLinearCell(eqx.Module):
    """A cell with a matrix state, `S_t = a_t[:, :, None] * S_{t-1} + k_t[:, :, None]
    * v_t[:, None, :]` per head, read out as `o_t = einsum("hk,hkv->hv", q_t, S_t)`
    (gated linear attention, Mamba-2's SSD).

    A subclass defines `gates(x_t) -> (a_t, k_t, v_t, q_t)` with shapes
    `a, k, q: [H, dk]` and `v: [H, dv]`; the state `S` is `[H, dk, dv]`.
    `__call__(x_t, S)` returns the new `S` (the `cell(x, h) -> h` convention, for
    decoding) and `output(S_t, x_t)` the read-out `o_t`.
    [`eqxscan.Recurrent`][] with such a cell returns `(S_T, os)` with `os[t] = o_t`,
    not the stacked states: stacking them would cost `T * H * dk * dv` and defeat
    the chunked form.
    """

    parallel_safe: ClassVar[bool] = False  # as DiagonalLinearCell's

    @abc.abstractmethod
    def gates(self, x_t: PyTree) -> tuple[Array, Array, Array, Array]:
        """**Returns:** `(a_t, k_t, v_t, q_t)`, shapes `[H, dk]`, `[H, dk]`,
        `[H, dv]`, `[H, dk]`."""

    def __call__(
        self, x_t: PyTree, S: Inexact[Array, "H dk dv"], *args: PyTree, **kwargs: PyTree
    ) -> Inexact[Array, "H dk dv"]:
        """One step: the new state `S_t` (the recurrent form, for decoding)."""
        a, k, v, _ = check_gates_tuple(self, self.gates(x_t, *args, **kwargs), 4)
        check_gate_fits(a, S, f"a from {type(self).__name__}.gates")
        new = a[:, :, None] * S + k[:, :, None] * v[:, None, :]
        return new.astype(S.dtype)

    def output(
        self,
        S_t: Inexact[Array, "H dk dv"],
        x_t: PyTree,
        *args: PyTree,
        **kwargs: PyTree,
    ) -> Inexact[Array, "H dv"]:
        """The read-out `o_t = einsum("hk,hkv->hv", q_t, S_t)` of the state after
        consuming `x_t`."""
        q = check_gates_tuple(self, self.gates(x_t, *args, **kwargs), 4)[3]
        return jnp.einsum("hk,hkv->hv", q, S_t)
