"""What `checkpoint="auto"` and `unroll="auto"` pick, from the traced step's shapes.

When the scan body is traced, every shape is known. `measure_traced` reads the
jaxpr the engine traced the step to (once; nothing runs) and counts:

- the bytes a plain scan would save per step for the backward pass (the
  residuals of `jax.vjp` of the step, less the step's inputs and the values it
  closes over, which a scan does not stack),
- the same under the matmul-saving policy (`dots_with_no_batch_dims_saveable`),
- the bytes of the carry and how many arrays it holds, and
- the FLOPs of one step (`2·M·N·K` per matmul, one per element of everything else).

`decide` turns those into a choice with the rule documented in
docs/default-checkpoint.md, whose constants are defined below.
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.custom_batching import custom_vmap
from jaxtyping import PyTree

from ._options import Checkpoint
from ._remat import Policy


T = TypeVar("T")


#: Residuals (bytes per step × length) a plain scan may save while "auto" still
#: saves everything: small in absolute terms, well below any accelerator's memory.
SMALL_RESIDUALS = 4 * 2**20
#: ... provided they are mostly matmul outputs: at most this many times what the
#: matmul-saving policy keeps. The unrolled loop saves the matmul outputs too, but
#: XLA fuses away elementwise intermediates there, which a plain scan must stack.
#: Measured (temp memory of saving everything against the loop's): a GRU cell
#: (1.14× the policy's bytes) 1.09×, an LSTM cell (1.22×) 1.50×, an MLP block
#: (5.4×) 1.2-1.75×; the threshold keeps the first and excludes the others.
MATMUL_DOMINATED = 1.2
#: Platforms where the rules measured on the CPU grid apply: full remat for small
#: steps and for large matmul outputs, and saving everything when matmul outputs
#: are nearly all a plain scan saves. On accelerators matmuls dominate, and the
#: matmul-saving policy avoids a second forward pass at every size.
CPU_PLATFORMS = ("cpu",)
#: On those platforms, full remat for steps of fewer FLOPs than this. In two quiet
#: runs of the CPU grid, full remat beat the policy for steps of up to 4.3e6 FLOPs
#: (narrow MLPs, small GRU/LSTM cells: the policy took 1.01-1.22× its time), with
#: the least memory; at 1.7e7-3.5e7 FLOPs (MLP width 128, cells of 256) the policy
#: was as fast or faster (0.91-1.00×, once 1.05-1.11×), and beyond, the two were
#: within 10% either way.
FULL_REMAT_FLOPS = 10**7
#: ... and, on those platforms, at any step size when the matmul outputs alone
#: would take more than this (bytes per step × length). Writing them in the
#: forward pass and reading them back in the backward pass then cost as much as
#: recomputing: in five quiet grid runs full remat took 0.90-0.97x the policy's
#: time for a GRU of 256 over 300 steps (131 MiB of matmul outputs) and
#: 0.94-1.02x for the LSTM (169 MiB), and 1.01x for the 64-layer Transformer
#: bench (72 MiB), with 0.17-0.40x its temp memory (two later runs, with
#: confirming rounds, had it at 1.04-1.05x for the GRU and 1.02x for the LSTM:
#: a few percent, at 0.40x the memory, so the line stands). Below it the two traded
#: places by up to 13% either way (the policy ahead for cells over 30 steps and
#: MLPs of width 128, remat for width 256), so the FLOPs bound decides there.
FULL_REMAT_RESIDUALS = 64 * 2**20
#: ... and, on those platforms, save everything at any size when a plain scan
#: saves at most this many times what the policy keeps (recurrent cells: GRU
#: 1.14×, LSTM 1.22×). The policy would keep over 80% of it anyway; recomputing
#: the rest saves little memory and costs a pass over the step's elementwise
#: work. For GRU/LSTM cells of 256 and 512 over 30-60 steps, saving everything
#: took 0.90-1.01× the policy's time (0.97 typical), with 1.15-1.2× its temp
#: memory and 0.33-0.77× the unrolled loop's.
NEARLY_ALL_MATMUL = 1.25
#: Scans of at most `SHORT_SCAN` steps of under `UNROLL_FLOPS` in all (steps ×
#: FLOPs per step) are unrolled fully (`unroll=True`: the loop's own program, at
#: most `SHORT_SCAN` bodies). At such sizes a scan's per-step cost (slicing each
#: layer's weights out of the stack, writing each gradient back) is not hidden by
#: the step's work: on the CPU grid at L=4 the loop ran 1.05-1.26x faster than the
#: best scan for MLPs up to width 256 (6.8e7 FLOPs per step), and in a probe at
#: L=5-8 the default scan took 1.03-1.15x the loop's time for widths 48-256 and,
#: over 8 steps, 1.08-1.21x for three GRU/LSTM cells of 64-256. The loop won at
#: every probed point under 8e8 FLOPs in all but two (by 2-4%), and the scan at
#: every point above (width 1024 at L=4, widths 320-512 at L=6-8: 0.91-0.96x).
#: A stack whose layers may be sharded (`layer_sharding`, `Explicit` axes in
#: their types, an `Auto` mesh in `jax.set_mesh`) stays a scan: unrolled, XLA
#: may gather every layer at once.
SHORT_SCAN = 8
UNROLL_FLOPS = 8 * 10**8
#: On `CPU_PLATFORMS`, a scan over time (`Recurrent`: the cell's weights closed
#: over, their gradient summed across steps) whose carry is one array and whose
#: step saves nearly only matmul outputs (at most `NEARLY_ALL_MATMUL` times what
#: the policy keeps) and costs at least `TIME_UNROLL_FLOPS` is unrolled by 2. In
#: 41 interleaved rounds on two cores (batch 64 unless stated, 30 steps unless
#: stated; benchmarks/time_unroll.py) `unroll=2` took 0.90-1.06x the time of
#: `unroll=1` for such cells in two runs (median 0.96-0.98x: GRUs of 128-512 fed
#: 8 or 256 inputs, batch 256 too, and over 300 steps; Elman cells of 256-1024;
#: the one loss over 2%, 1.02-1.06x, was the GRU of 256 fed 256 inputs), at the
#: same temp memory. Below the FLOPs bound it did not pay (a GRU of 256 at batch
#: 16: 0.99-1.02x; GRUs and Elman cells of 32: 1.10-1.29x), nor for the LSTM,
#: whose carry is two arrays (1.11-1.13x for 256; the slowdown follows its
#: cell-state recurrence, in hand-written JAX too). On one core the GRU of 256
#: neither gained nor lost (0.98-1.00x). Scans over layers keep 1 (0.96-1.05x for
#: MLPs of width 32-256, at 1.07-1.38x the temp memory).
TIME_UNROLL, TIME_UNROLL_FLOPS = 2, 10**7


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one traced scan step costs (see the module docstring)."""

    length: int
    flops: int
    carry_bytes: int
    saved_bytes: int
    policy_saved_bytes: int
    carry_arrays: int = 1


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What `"auto"` chose for one scan, and why.

    **Fields:**

    - `checkpoint`: the resolved option: `False` (save everything), `True` (full
      remat) or a `jax.checkpoint_policies` policy.
    - `unroll`: the resolved `unroll`.
    - `reason`: one sentence with the numbers behind the choice.
    - `cost`: the measured [`StepCost`][eqxscan.StepCost].
    - `where`: which scan (the layer type or cell, as in error messages).
    """

    checkpoint: Checkpoint
    unroll: int | bool
    reason: str
    cost: StepCost
    where: str

    @property
    def checkpoint_name(self) -> str:
        if callable(self.checkpoint):
            return getattr(self.checkpoint, "__name__", repr(self.checkpoint))
        return repr(self.checkpoint)

    def __repr__(self) -> str:
        return (
            f"AutoChoice(checkpoint={self.checkpoint_name}, unroll={self.unroll!r}, "
            f"where={self.where!r}, reason={self.reason!r})"
        )


def _mib(n: int | float) -> str:
    if n < 2**20:
        return f"{n / 2**10:.1f} KiB"
    return f"{n / 2**20:.2f} MiB"


def decide(
    cost: StepCost,
    checkpoint: Any,
    unroll: Any,
    policy: Callable,
    platform: str,
    *,
    gathered: bool = False,
    over: Literal["layers", "time"] = "layers",
) -> tuple[Checkpoint, int | bool, str]:
    """Resolve `"auto"` in `checkpoint` and/or `unroll`; explicit values pass through.

    - `unroll="auto"`: `True` (unroll fully) for at most `SHORT_SCAN` steps of
      under `UNROLL_FLOPS` in all, unless each step may gather its own sharded
      weights (`gathered`, FSDP: unrolled, XLA may gather all of them at once).
      Else, on `CPU_PLATFORMS`, `TIME_UNROLL` for a scan `over` time whose carry
      is one array and whose step saves at most `NEARLY_ALL_MATMUL` times what
      `policy` does and costs at least `TIME_UNROLL_FLOPS`. Else 1
      (docs/default-checkpoint.md).
    - `checkpoint="auto"`: `False` when unrolled fully (the loop's program: XLA
      fuses what it need not save). Otherwise save everything (`False`) when a
      plain scan's residuals are at most `SMALL_RESIDUALS` and at most
      `MATMUL_DOMINATED` times what `policy` saves. Otherwise, on `CPU_PLATFORMS`:
      full remat (`True`) for steps under `FULL_REMAT_FLOPS` or when what
      `policy` saves exceeds `FULL_REMAT_RESIDUALS`, else save everything when
      that is at most `NEARLY_ALL_MATMUL` times what `policy` saves. Elsewhere
      `policy`.
    """
    reasons = []
    if unroll == "auto":
        if gathered:
            unroll = 1
            reasons.append(
                "the layers may be sharded (layer_sharding, Explicit mesh axes "
                "in their types, or an Auto mesh set with jax.set_mesh), so each "
                "step may gather its own: keep the scan, unroll 1"
            )
        elif cost.length <= SHORT_SCAN and cost.length * cost.flops < UNROLL_FLOPS:
            unroll = True
            reasons.append(
                f"{cost.length} steps of {cost.flops:.3g} FLOPs (at most "
                f"{SHORT_SCAN}, under {UNROLL_FLOPS:.0e} in all): unroll fully"
            )
        elif (
            over == "time"
            and platform in CPU_PLATFORMS
            and cost.carry_arrays == 1
            and cost.flops >= TIME_UNROLL_FLOPS
            and cost.saved_bytes <= NEARLY_ALL_MATMUL * cost.policy_saved_bytes
        ):
            unroll = TIME_UNROLL
            reasons.append(
                f"on {platform}, {cost.length} time steps of {cost.flops:.3g} FLOPs "
                f"(>= {TIME_UNROLL_FLOPS:.0e}), one carried array, nearly all "
                f"matmul outputs: unroll {TIME_UNROLL}"
            )
        else:
            unroll = 1
            why = ""
            if over == "time" and platform in CPU_PLATFORMS:
                if cost.carry_arrays != 1:
                    why = f", {cost.carry_arrays} carried arrays"
                elif cost.flops < TIME_UNROLL_FLOPS:
                    why = f" (< {TIME_UNROLL_FLOPS:.0e})"
                else:
                    why = ", not nearly all matmul outputs"
            reasons.append(
                f"{cost.length} steps of {cost.flops:.3g} FLOPs{why}: unroll 1"
            )
    if checkpoint == "auto" and unroll is True:
        checkpoint = False
        reasons.append("unrolled fully, so save what the loop saves")
    elif checkpoint == "auto":
        total = cost.saved_bytes * cost.length
        ratio = cost.saved_bytes / max(cost.policy_saved_bytes, 1)
        facts = (
            f"a plain scan saves {_mib(total)}, {ratio:.2f}x what saving matmul "
            f"outputs keeps ({_mib(cost.policy_saved_bytes * cost.length)})"
        )
        if total <= SMALL_RESIDUALS and ratio <= MATMUL_DOMINATED:
            checkpoint = False
            reasons.append(
                f"{facts}: at most {_mib(SMALL_RESIDUALS)} and "
                f"{MATMUL_DOMINATED}x, so save everything"
            )
        else:
            why = (
                f"more than {_mib(SMALL_RESIDUALS)}"
                if total > SMALL_RESIDUALS
                else f"more than {MATMUL_DOMINATED}x"
            )
            # Full remat on the platforms where it pays: small steps, or more
            # matmul outputs than are worth writing out and reading back.
            remat_because, link = None, "so"
            if platform in CPU_PLATFORMS:
                if cost.flops < FULL_REMAT_FLOPS:
                    remat_because = (
                        f"{cost.flops:.3g} FLOPs per step (< {FULL_REMAT_FLOPS:.0e})"
                    )
                elif cost.policy_saved_bytes * cost.length > FULL_REMAT_RESIDUALS:
                    remat_because = (
                        f"more than {_mib(FULL_REMAT_RESIDUALS)} of matmul outputs"
                    )
            if remat_because is not None:
                checkpoint = True
                what = f"on {platform}, with {remat_because}, recompute the whole step"
            elif platform in CPU_PLATFORMS and ratio <= NEARLY_ALL_MATMUL:
                checkpoint = False
                what = (
                    f"on {platform} at most {NEARLY_ALL_MATMUL}x is nearly all matmul "
                    "outputs: save everything"
                )
                link = "but"
            else:
                checkpoint = policy
                what = "save matmul outputs and recompute the rest"
            reasons.append(f"{facts}: {why}, {link} {what}")
    return checkpoint, unroll, "; ".join(reasons)


# ---------------------------------------------------------------------------
# Measuring the step.


def _nbytes(aval: jax.ShapeDtypeStruct | jax.core.ShapedArray) -> int:
    dtype = aval.dtype  # type: ignore[union-attr]
    # PRNG keys have an extended dtype, which NumPy cannot interpret.
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        dtype = jnp.dtype(dtype)
    shape = aval.shape  # type: ignore[union-attr]
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def _saved_bytes(jaxpr: jcore.ClosedJaxpr, n_carry: int, policy: Policy | None) -> int:
    """Bytes of the residuals of `vjp` of the traced step `jaxpr` that a scan
    would stack per step: not the step's per-step inputs (scanned already) nor
    its consts (closed-over values, the same at every step); the incoming carry
    does count. Differentiates the jaxpr: the step's Python code does not run."""
    step = jcore.jaxpr_as_fun(jaxpr)
    fn = step if policy is None else jax.checkpoint(step, policy=policy)

    def residuals(*leaves: jax.Array) -> object:
        return jax.vjp(fn, *leaves)[1]

    try:
        vjp_jaxpr = jax.make_jaxpr(residuals)(*jaxpr.in_avals).jaxpr
    except (TypeError, ValueError, NotImplementedError):
        # A step that cannot be reverse-differentiated (a callback without a
        # derivative, say) has no residuals to weigh, and remat changes nothing.
        return 0
    not_stacked = set(vjp_jaxpr.invars[n_carry:]) | set(vjp_jaxpr.constvars)
    seen, total = set(), 0
    for v in vjp_jaxpr.outvars:
        if not isinstance(v, jcore.Var) or v in not_stacked or v in seen:
            continue
        seen.add(v)
        total += _nbytes(v.aval)
    return total


def _flops(jaxpr: jcore.Jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if subs:
            times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            # Branches of a `cond` are alternatives: count the most expensive.
            inner = [_flops(s) for s in subs]
            total += times * (
                max(inner) if eqn.primitive.name == "cond" else sum(inner)
            )
            continue
        out = sum(int(np.prod(v.aval.shape, dtype=np.int64)) for v in eqn.outvars)
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            k = int(np.prod([lhs[d] for d in lhs_contract], dtype=np.int64))
            total += 2 * out * k
        else:
            total += out
    return total


# How many copies `jax.vmap` runs at once, read through the public batching API:
# `_probe` is the identity, and under `vmap` its rule is called with the batch
# size (then passes the value on, to any `vmap` further out). Outside `vmap` it
# is a no-op, removed with the rest of the dead code when lowered.
_SIZES: list[int] = []


@custom_vmap
def _probe(a: jax.Array) -> jax.Array:
    return a


@_probe.def_vmap
def _probe_rule(
    axis_size: int, in_batched: list[bool], a: jax.Array
) -> tuple[jax.Array, bool]:
    _SIZES.append(axis_size)
    return _probe(a), in_batched[0]


def _vmapped_size(x: object) -> int:
    """How many copies of `x` `jax.vmap` runs at once (1 outside `vmap`).

    `vmap` hides its batch from the traced step, whose shapes are per example,
    yet the batch multiplies every byte and FLOP. Nested `vmap`s multiply; a
    `jit` inside the `vmap` hides it (1 is assumed)."""
    if not eqx.is_array(x) or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return 1
    del _SIZES[:]
    # Without gradients: a derivative trace would wrap the value the rule sees.
    _probe(jax.lax.stop_gradient(x))
    size = int(np.prod(_SIZES, dtype=np.int64))
    del _SIZES[:]
    return size


def measure_traced(
    jaxpr: jcore.ClosedJaxpr,
    n_carry: int,
    values: PyTree[jax.Array],
    length: int,
    policy: Policy,
) -> StepCost:
    """The [`StepCost`][eqxscan.StepCost] of a step traced once to `jaxpr` (whose
    first `n_carry` inputs are the carry's leaves) over `length` steps, for the
    whole `vmap` batch of `values` (the carry and `xs`) when there is one."""
    batch = max([_vmapped_size(a) for a in jtu.tree_leaves(values)] or [1])
    carry = jaxpr.in_avals[:n_carry]
    return StepCost(
        length=length,
        flops=batch * _flops(jaxpr.jaxpr),
        carry_bytes=batch * sum(_nbytes(a) for a in carry),
        saved_bytes=batch * _saved_bytes(jaxpr, n_carry, None),
        policy_saved_bytes=batch * _saved_bytes(jaxpr, n_carry, policy),
        carry_arrays=n_carry,
    )


def measure(
    step: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    carry: PyTree[jax.Array],
    xs: PyTree[jax.Array],
    length: int,
    policy: Policy,
) -> StepCost:
    """The [`StepCost`][eqxscan.StepCost] of `step(carry, x_i)` over `length` steps
    (traced once here; the engine measures the jaxpr it traced already)."""
    x = jtu.tree_map(lambda a: jcore.mapped_aval(length, 0, jax.typeof(a)), xs)
    c = jtu.tree_map(jax.typeof, carry)
    jaxpr = jax.make_jaxpr(step)(c, x)
    n_carry = len(jtu.tree_leaves(carry))
    return measure_traced(jaxpr, n_carry, (carry, xs), length, policy)


# ---------------------------------------------------------------------------
# Resolving inside the engine, and reporting it.

_RECORDERS: list[list[AutoChoice]] = []


def resolve(
    jaxpr: jcore.ClosedJaxpr,
    n_carry: int,
    values: PyTree[jax.Array],
    length: int,
    checkpoint: T,
    unroll: int | bool | Literal["auto"],
    policy: Policy,
    where: str,
    gathered: bool = False,
    over: Literal["layers", "time"] = "layers",
) -> tuple[T | Checkpoint, int | bool]:
    """`(checkpoint, unroll)` with any `"auto"` replaced by the rule's choice,
    measured on the step traced once to `jaxpr` (see `measure_traced`)."""
    if checkpoint != "auto" and unroll != "auto":
        return checkpoint, unroll  # type: ignore[return-value]
    cost = measure_traced(jaxpr, n_carry, values, length, policy)
    platform = jax.default_backend()
    checkpoint, unroll, reason = decide(
        cost, checkpoint, unroll, policy, platform, gathered=gathered, over=over
    )
    for record in _RECORDERS:
        record.append(AutoChoice(checkpoint, unroll, reason, cost, where))
    return checkpoint, unroll


@contextlib.contextmanager
def _recording() -> Iterator[list[AutoChoice]]:
    record: list[AutoChoice] = []
    _RECORDERS.append(record)
    try:
        yield record
    finally:
        _RECORDERS.remove(record)


def explain_auto(fn: Callable, *args: Any, **kwargs: Any) -> list[AutoChoice]:
    """What `checkpoint="auto"` and `unroll="auto"` pick for every scan that
    `fn(*args, **kwargs)` runs, and why.

    `fn` is traced abstractly (`jax.eval_shape`): nothing is computed. The choice
    depends only on shapes and dtypes, so it is the one a jitted train step makes.

    **Arguments:**

    - `fn`: a module (`Stacked`, `Chain`, `Recurrent`, `StackedMLP`, ...) or any
      function that calls one.
    - `*args`, `**kwargs`: example inputs (arrays or `jax.ShapeDtypeStruct`s).

    **Returns:**

    A list of [`AutoChoice`][eqxscan.AutoChoice], one per scan in call order (one
    for a `Stacked`, one per scanned group of a `Chain`, two for a
    `Bidirectional`); empty when no scan used `"auto"`.
    """
    with _recording() as record:
        eqx.filter_eval_shape(fn, *args, **kwargs)
    return list(record)
