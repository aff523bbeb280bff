"""The default: what `remat="auto"` and `unroll="auto"` pick, from the
traced step's shapes. `measure_traced` reads the step's jaxpr (nothing runs)
into a `StepCost`; `decide` applies `unroll_rule` and `remat_rule` over
`THRESHOLDS`. docs/default-remat.md has the table and the measurements behind
every threshold."""

import dataclasses
from collections.abc import Callable
from typing import Literal, TypeAlias

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jcore
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .call_state import call_state, changed_call_state
from .options import Remat
from .scan_remat import as_scan_remat, matmul_policy, Policy, ScanRemat, Traced
from .setting_names import remat_label, size_label
from .vmap_batch import vmapped_size


Over: TypeAlias = Literal["layers", "time"]
"""What a scan's steps are: `"layers"` (each step's weights in `xs`) or `"time"` (a
cell's weights closed over, their gradient summed across steps)."""


@dataclasses.dataclass(frozen=True)
class Thresholds:
    """The numbers of the rule, one per line; docs/default-remat.md has the
    measurements behind each. Byte totals are per step × the scan's length."""

    #: Save everything when a plain scan's residuals are at most this ...
    small_residuals: int = 4 * 2**20
    #: ... and at most this many times what the matmul-saving policy keeps.
    matmul_dominated: float = 1.2
    #: Platforms where the CPU-measured rules (marked CPU below) apply.
    cpu_platforms: tuple[str, ...] = ("cpu",)
    #: CPU: full remat for steps of fewer FLOPs than this ...
    full_remat_flops: int = 10**7
    #: CPU: ... or when the matmul-saving policy's residuals exceed this.
    full_remat_residuals: int = 64 * 2**20
    #: CPU: else save everything when that is at most this × what the policy keeps.
    nearly_all_matmul: float = 1.25
    #: Unroll fully a scan of at most this many steps ...
    short_scan: int = 8
    #: ... of fewer FLOPs than this in all (steps × FLOPs per step) ...
    unroll_flops: int = 8 * 10**8
    #: ... and, over layers, whose other steps' inputs (weights, all sliced out
    #: of the stack at once when unrolled) total at most this.
    unroll_copies: int = 32 * 2**10
    #: CPU: unroll by this a scan over time with one carried array, a step of
    #: nearly all matmul outputs (`nearly_all_matmul`) ...
    time_unroll: int = 2
    #: CPU: ... and of at least this many FLOPs.
    time_unroll_flops: int = 10**7
    #: Any platform: save everything when a step's carry is at least this many
    #: times what a plain scan saves a step (a remat'd step saves its carry: a
    #: KV cache carried whole, once a layer).
    carry_bound: float = 2.0
    #: Not CPU: unroll fully a scan over layers of at most this many steps ...
    memory_bound_layers: int = 32
    #: ... whose step does at most this many FLOPs per byte of its weights (a
    #: decode step: the scan's per-step cost is not hidden behind its work).
    memory_bound_intensity: int = 256


#: The thresholds `"auto"` uses.
THRESHOLDS = Thresholds()

UnrollRule: TypeAlias = Literal[
    "given", "sharded", "short", "copies", "memory-bound", "time", "remat", "scan"
]
"""Which rule set `unroll` (docs/default-remat.md lists them)."""

RematRule: TypeAlias = Literal[
    "given",
    "unrolled",
    "small",
    "carry",
    "small-step",
    "large-matmuls",
    "nearly-all-matmul",
    "policy",
]
"""Which rule set `remat` (docs/default-remat.md lists them)."""


@dataclasses.dataclass(frozen=True)
class StepCost:
    """What one traced scan step of a scan of `length` costs, for a whole `vmap`
    batch: its `flops` (`2·M·N·K` per matmul, one per element of anything else),
    its carry's bytes and arrays, the bytes a plain scan saves per step for the
    backward pass (the residuals of `jax.vjp` of the step, less its inputs and
    consts) and the same under the matmul-saving policy."""

    length: int
    flops: int
    carry_bytes: int
    saved_bytes: int
    policy_saved_bytes: int
    carry_arrays: int = 1
    #: Bytes of one step's own inputs (a layer's weights and per-layer values).
    xs_bytes: int = 0
    #: Of those, the bytes that unrolled, XLA copies or converts out of the
    #: stack for all layers at once instead of reading them in place: integers
    #: the step unpacks by bit shifts (int4 held packed), and anything it hands
    #: to a kernel (Pallas, FFI). The memory-bound unroll allows 1% of them.
    xs_copied_bytes: int = 0

    @property
    def copies_total(self) -> int:
        """Bytes of the other steps' inputs an unrolled program slices at once."""
        return self.xs_bytes * max(self.length - 1, 0)

    @property
    def saved_total(self) -> int:
        return self.saved_bytes * self.length

    @property
    def policy_total(self) -> int:
        return self.policy_saved_bytes * self.length

    @property
    def ratio(self) -> float:
        """What a plain scan saves ÷ what the matmul-saving policy keeps."""
        return self.saved_bytes / max(self.policy_saved_bytes, 1)


def unroll_rule(
    cost: StepCost, platform: str, gathered: bool, over: Over, t: Thresholds
) -> UnrollRule:
    """The rule for `unroll="auto"`: the first that applies."""
    if gathered:
        return "sharded"
    if (
        over == "layers"
        and platform not in t.cpu_platforms
        and 1 < cost.length <= t.memory_bound_layers
        and cost.flops <= t.memory_bound_intensity * cost.xs_bytes
        and cost.xs_copied_bytes * 100 <= cost.xs_bytes
    ):
        # Measured on a TPU v5e (16 layers, D=2048 decode): unrolled, the step
        # reads each layer's weights in place (float, int8, fp8, native int4),
        # as the loop does; but XLA unpacked packed int4 bytes for all layers
        # at once (902 MiB of temp, 3.6x slower) and copied the Pallas
        # kernel's int8 operands (386 MiB, 1.7x slower): those stay scans.
        return "memory-bound"
    if cost.length <= t.short_scan and cost.length * cost.flops < t.unroll_flops:
        if over == "layers" and cost.copies_total > t.unroll_copies:
            # The loop's temp memory holds one layer's weights at a time.
            return "copies"
        return "short"
    if (
        over == "time"
        and platform in t.cpu_platforms
        and cost.carry_arrays == 1
        and cost.flops >= t.time_unroll_flops
        and cost.ratio <= t.nearly_all_matmul
    ):
        return "time"
    return "scan"


def remat_rule(cost: StepCost, platform: str, t: Thresholds) -> RematRule:
    """The rule for `remat="auto"` in a scan not unrolled fully: the first
    that applies."""
    cpu = platform in t.cpu_platforms
    if cost.saved_total <= t.small_residuals and cost.ratio <= t.matmul_dominated:
        return "small"
    if cost.carry_bytes >= t.carry_bound * cost.saved_bytes:
        return "carry"
    if cpu and cost.flops < t.full_remat_flops:
        return "small-step"
    if cpu and cost.policy_total > t.full_remat_residuals:
        return "large-matmuls"
    if cpu and cost.ratio <= t.nearly_all_matmul:
        return "nearly-all-matmul"
    return "policy"


@dataclasses.dataclass(frozen=True)
class AutoRule:
    """Which rules of `"auto"` fired for one scan (an `UnrollRule` and a
    `RematRule`), on which `platform` (`jax.default_backend()`), for steps
    `over` layers or time, and the `thresholds` they compared with."""

    unroll: UnrollRule
    remat: RematRule
    platform: str
    over: Over = "layers"
    thresholds: Thresholds = dataclasses.field(default=THRESHOLDS, repr=False)


def _unroll_reason(rule: AutoRule, cost: StepCost) -> str:
    t, on = rule.thresholds, rule.platform
    steps = f"{cost.length} steps of {cost.flops:.3g} FLOPs"
    said = {
        "sharded": "the layers may be sharded (layer_sharding, Explicit mesh axes "
        "in their types, or an Auto mesh set with jax.set_mesh), so each step may "
        "gather its own: keep the scan, unroll 1",
        "short": f"{steps} (at most {t.short_scan}, under {t.unroll_flops:.0e} in "
        "all): unroll fully",
        "copies": f"{steps} (at most {t.short_scan}), but unrolled the other "
        f"layers' weights ({size_label(cost.copies_total)}, more than "
        f"{size_label(t.unroll_copies)}) would be copied at once: unroll 1",
        "memory-bound": f"on {on}, {steps} (at most {t.memory_bound_layers}), "
        f"at most {t.memory_bound_intensity} FLOPs per byte of a layer's weights "
        f"({size_label(cost.xs_bytes)}): bound by reading them, unroll fully",
        "time": f"on {on}, {cost.length} time steps of {cost.flops:.3g} FLOPs (>= "
        f"{t.time_unroll_flops:.0e}), one carried array, nearly all matmul "
        f"outputs: unroll {t.time_unroll}",
        "remat": f"{steps}; a remat was given, which a scan keeps (unrolled, "
        "XLA may recompute nothing): unroll 1",
    }
    if rule.unroll in said:
        return said[rule.unroll]
    why = ""  # why a scan was kept that the memory-bound or time rule might unroll
    in_place = dataclasses.replace(cost, xs_copied_bytes=0)  # as if read in place
    if rule.unroll == "scan" and unroll_rule(in_place, on, False, rule.over, t) == (
        "memory-bound"
    ):
        why = (
            f", {size_label(cost.xs_copied_bytes)} of each step's inputs unpacked "
            "by bit shifts or handed to a kernel (unrolled, copied for all steps)"
        )
    elif rule.over == "time" and on in t.cpu_platforms:
        if cost.carry_arrays != 1:
            why = f", {cost.carry_arrays} carried arrays"
        elif cost.flops < t.time_unroll_flops:
            why = f" (< {t.time_unroll_flops:.0e})"
        else:
            why = ", not nearly all matmul outputs"
    return f"{steps}{why}: unroll 1"


def _remat_reason(rule: AutoRule, cost: StepCost) -> str:
    t, on = rule.thresholds, rule.platform
    if rule.remat == "unrolled":
        return "unrolled fully, so save what the loop saves"
    facts = (
        f"a plain scan saves {size_label(cost.saved_total)}, {cost.ratio:.2f}x what "
        f"saving matmul outputs keeps ({size_label(cost.policy_total)})"
    )
    if rule.remat == "small":
        over = f"at most {size_label(t.small_residuals)} and {t.matmul_dominated}x"
    elif cost.saved_total > t.small_residuals:
        over = f"more than {size_label(t.small_residuals)}"
    else:
        over = f"more than {t.matmul_dominated}x"
    verdict = {
        "small": "so save everything",
        "carry": f"but recomputing saves each step's carry ("
        f"{size_label(cost.carry_bytes)}), at least {t.carry_bound}x what a plain "
        f"scan saves a step ({size_label(cost.saved_bytes)}): save everything",
        "small-step": f"so on {on}, with {cost.flops:.3g} FLOPs per step (< "
        f"{t.full_remat_flops:.0e}), recompute the whole step",
        "large-matmuls": f"so on {on}, with more than "
        f"{size_label(t.full_remat_residuals)} of matmul outputs, recompute the "
        "whole step",
        "nearly-all-matmul": f"but on {on} at most {t.nearly_all_matmul}x is nearly "
        "all matmul outputs: save everything",
        "policy": "so save matmul outputs and recompute the rest",
    }[rule.remat]
    return f"{facts}: {over}, {verdict}"


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What `"auto"` chose for one scan, and why.

    **Fields:**

    - `remat`: the resolved option: `False` (save everything), `True` (full
      remat) or a `jax.checkpoint_policies` policy.
    - `unroll`: the resolved `unroll`.
    - `rule`: which rule fired: `rule.unroll` and `rule.remat` name it
      (`"given"` where the option was explicit; the values are listed in
      docs/default-remat.md).
    - `cost`: the measured [`StepCost`][eqxscan.remat.StepCost].
    - `where`: which scan (the layer type or cell, as in error messages).

    `reason` is one sentence with the numbers behind the choice, derived from
    `rule` and `cost`.
    """

    remat: Remat
    unroll: int | bool
    rule: AutoRule
    cost: StepCost
    where: str

    @property
    def reason(self) -> str:
        parts = []
        if self.rule.unroll != "given":
            parts.append(_unroll_reason(self.rule, self.cost))
        if self.rule.remat != "given":
            parts.append(_remat_reason(self.rule, self.cost))
        return "; ".join(parts)

    def __repr__(self) -> str:
        return (
            f"AutoChoice(remat={remat_label(self.remat)}, unroll={self.unroll!r}, "
            f"rule=({self.rule.remat!r}, {self.rule.unroll!r}), "
            f"where={self.where!r}, reason={self.reason!r})"
        )


def decide(
    cost: StepCost,
    remat: Remat,
    unroll: int | bool | Literal["auto"],
    platform: str,
    gathered: bool = False,
    over: Over = "layers",
    where: str = "",
) -> AutoChoice:
    """Resolve `"auto"` in `remat` and/or `unroll` by `unroll_rule` and
    `remat_rule` (with `THRESHOLDS`); explicit values pass through. `gathered`:
    each step may gather its own sharded weights (FSDP)."""
    t = THRESHOLDS
    u_rule: UnrollRule = "given"
    if isinstance(unroll, str):  # "auto"
        u_rule = unroll_rule(cost, platform, gathered, over, t)
        if u_rule in ("short", "memory-bound", "time") and remat not in (False, "auto"):
            # An explicit remat is kept by a scan: unrolled, XLA:CPU recomputed
            # nothing and `remat=True` held more temp than `False`.
            u_rule = "remat"
        unrolls = {"short": True, "memory-bound": True, "time": t.time_unroll}
        steps = unrolls.get(u_rule, 1)
    else:
        steps = unroll
    c_rule: RematRule = "given"
    if remat == "auto":
        c_rule = "unrolled" if steps is True else remat_rule(cost, platform, t)
        full = c_rule in ("small-step", "large-matmuls")
        remat = matmul_policy if c_rule == "policy" else full
    rule = AutoRule(u_rule, c_rule, platform, over, t)
    return AutoChoice(remat, steps, rule, cost, where)


# Measuring the step.


def _shape(aval: jax.core.AbstractValue) -> tuple[int, ...]:
    # A value without a shape (a token) counts as a scalar.
    return aval.shape if isinstance(aval, jax.core.ShapedArray) else ()


def _size(aval: jax.core.AbstractValue) -> int:
    return int(np.prod(_shape(aval), dtype=np.int64))


def _nbytes(aval: jax.core.AbstractValue) -> int:
    # A PRNG key's extended dtype has an itemsize too; int4 is half a byte.
    if not isinstance(aval, jax.core.ShapedArray):
        return 0
    d = aval.dtype
    bits = jnp.iinfo(d).bits if jnp.issubdtype(d, jnp.integer) else 8 * d.itemsize
    return (_size(aval) * bits + 7) // 8


def _saved_bytes(jaxpr: jcore.ClosedJaxpr, n_carry: int, policy: Policy | None) -> int:
    """Bytes of the residuals of `vjp` of the step that a scan stacks per step:
    not its per-step inputs (scanned already) nor its consts; the incoming
    carry does count."""
    fn = step = jcore.jaxpr_as_fun(jaxpr)
    if policy is not None:
        fn = jax.checkpoint(step, policy=policy)  # pyright: ignore[reportArgumentType]  # jax says bool; offloading ones answer Offloadable
    try:
        vjp = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*jaxpr.in_avals).jaxpr
    except (TypeError, ValueError, NotImplementedError):
        # A step without a derivative (a callback, say) has no residuals to weigh.
        return 0
    not_stacked = set(vjp.invars[n_carry:]) | set(vjp.constvars)
    saved = {v for v in vjp.outvars if isinstance(v, jcore.Var)} - not_stacked
    return sum(_nbytes(v.aval) for v in saved)


def _sub_jaxprs(params: dict[str, object]) -> list[jcore.Jaxpr]:
    # `jax.extend.core.jaxprs_in_params` from jax 0.10 on; spelled out for 0.9.
    values = [v for p in params.values() for v in (p if isinstance(p, tuple) else (p,))]
    return [
        v.jaxpr if isinstance(v, jcore.ClosedJaxpr) else v
        for v in values
        if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))
    ]


def _flops(jaxpr: jcore.Jaxpr) -> int:
    # `2·M·N·K` per matmul, one per output element of anything else.
    total = 0
    for eqn in jaxpr.eqns:
        if subs := [_flops(s) for s in _sub_jaxprs(eqn.params)]:
            times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            # Branches of a `cond` are alternatives: count the most expensive.
            total += times * (max(subs) if eqn.primitive.name == "cond" else sum(subs))
            continue
        out = sum(_size(v.aval) for v in eqn.outvars)
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            lhs = _shape(eqn.invars[0].aval)
            out *= 2 * int(np.prod([lhs[d] for d in lhs_contract], dtype=np.int64))
        total += out
    return total


_SHIFTS = frozenset({"shift_left", "shift_right_arithmetic", "shift_right_logical"})
_KERNELS = frozenset({"pallas_call", "ffi_call"})
# What keeps an input's bits (moves, views, casts, masks); any other
# equation's outputs are new values.
_SAME_BITS = frozenset(
    {
        "convert_element_type",
        "bitcast_convert_type",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "slice",
        "copy",
        "and",
        "or",
        "not",
        "xor",
    }
)


def _copied_inputs(jaxpr: jcore.Jaxpr, platform: str) -> set[int]:
    """Positions of `jaxpr`'s inputs that reach a kernel's operands, or, for
    integers, a bit shift, with their bits kept on the way: on `platform`'s
    branch of each `jax.lax.platform_dependent`."""
    found: set[int] = set()
    integer = {
        i
        for i, v in enumerate(jaxpr.invars)
        if isinstance(v.aval, jax.core.ShapedArray)
        and jnp.issubdtype(v.aval.dtype, jnp.integer)
    }
    none: frozenset[int] = frozenset()
    # `jax.default_backend()` says "gpu"; `platform_dependent` names its kinds.
    names = {platform} | ({"cuda", "rocm"} if platform == "gpu" else set())

    def walk(jaxpr: jcore.Jaxpr, into: list[frozenset[int]]) -> list[frozenset[int]]:
        # `into[k]`: the outer inputs whose bits invar `k` holds; returns the
        # same for each output.
        came: dict[jcore.Var, frozenset[int]] = dict(zip(jaxpr.invars, into))

        def of(v: object) -> frozenset[int]:
            return came.get(v, none) if isinstance(v, jcore.Var) else none

        for eqn in jaxpr.eqns:
            ins = [of(v) for v in eqn.invars]
            every = none.union(*ins)
            outs = [none] * len(eqn.outvars)
            name = eqn.primitive.name
            if name in _KERNELS:
                found.update(every)
            elif name in _SHIFTS:
                found.update(every & integer)
            elif name in _SAME_BITS:
                outs = [every] * len(eqn.outvars)
            elif subs := _sub_jaxprs(eqn.params):
                if name == "cond":
                    ins = ins[1:]  # the branch index
                    if (where := eqn.params.get("branches_platforms")) is not None:
                        named = [i for i, p in enumerate(where) if p and names & set(p)]
                        default = [i for i, p in enumerate(where) if p is None]
                        subs = [subs[i] for i in (named or default)] or subs
                for sub in subs:
                    # Inputs in order where the counts agree (calls, branches,
                    # scans); otherwise every inner input from every outer one.
                    same = len(sub.invars) == len(ins)
                    got = walk(sub, ins if same else [every] * len(sub.invars))
                    if len(got) == len(outs):
                        outs = [o | g for o, g in zip(outs, got)]
            for v, o in zip(eqn.outvars, outs):
                came[v] = o
        return [of(v) for v in jaxpr.outvars]

    walk(jaxpr, [frozenset({i}) for i in range(len(jaxpr.invars))])
    return found


def measure_traced(
    jaxpr: jcore.ClosedJaxpr,
    n_carry: int,
    values: PyTree[jax.Array],
    length: int,
    platform: str,
) -> StepCost:
    """The [`StepCost`][eqxscan.remat.StepCost] of a step traced once to `jaxpr` (whose
    first `n_carry` inputs are the carry's leaves) over `length` steps, for the
    whole `vmap` batch of `values` (the carry and `xs`) when there is one, as
    it runs on `platform`."""
    avals = jaxpr.in_avals
    # Each input's own batch: weights a `vmap` does not map are held once.
    sizes = [vmapped_size(a) for a in jtu.tree_leaves(values)]
    outer = call_state().vmapped  # an eager `vmap`'s, around the program: its carry
    sizes = [s * outer if i < n_carry else s for i, s in enumerate(sizes)]
    batch = max(sizes or [1])
    if len(sizes) != len(avals):
        sizes = [batch] * len(avals)
    held = [size * _nbytes(a) for size, a in zip(sizes, avals, strict=True)]
    copied = _copied_inputs(jaxpr.jaxpr, platform)
    return StepCost(
        length=length,
        flops=batch * _flops(jaxpr.jaxpr),
        carry_bytes=sum(held[:n_carry]),
        saved_bytes=batch * _saved_bytes(jaxpr, n_carry, None),
        policy_saved_bytes=batch * _saved_bytes(jaxpr, n_carry, matmul_policy),
        carry_arrays=n_carry,
        xs_bytes=sum(held[n_carry:]),
        xs_copied_bytes=sum(held[i] for i in copied if i >= n_carry),
    )


# Resolving inside the engine, and reporting it.


def resolve(
    traced: Traced,
    values: PyTree[jax.Array],
    length: int,
    remat: ScanRemat,
    unroll: int | bool | Literal["auto"],
    where: str,
    gathered: bool = False,
    over: Over = "layers",
) -> tuple[ScanRemat, int | bool]:
    """`(remat, unroll)` with eqxscan's rule applied where it chooses
    (`remat.is_rule`, `unroll="auto"`), measured on the step traced once
    to `traced` (see `measure_traced`); other values pass through."""
    if not remat.is_rule and not isinstance(unroll, str):  # no "auto"
        return remat, unroll
    platform = jax.default_backend()
    cost = measure_traced(traced.jaxpr, traced.n_carry, values, length, platform)
    # The rule sees the value as a plain `remat=` option ("auto" when it chooses).
    given = remat if remat.named else remat.policy
    choice = decide(cost, given, unroll, platform, gathered, over, where)
    # The lists of the `explain_auto` calls open in this context.
    for record in call_state().auto_records:
        record.append(choice)
    return (as_scan_remat(choice.remat) if remat.is_rule else remat), choice.unroll


def explain_auto(
    fn: Callable[..., object], *args: PyTree, **kwargs: PyTree
) -> list[AutoChoice]:
    """What `remat="auto"` and `unroll="auto"` pick for every scan that
    `fn(*args, **kwargs)` runs, and why.

    `fn` is traced abstractly (`jax.eval_shape`): nothing is computed. The choice
    depends only on shapes and dtypes, so it is the one a jitted train step makes.
    A jitted `fn` (or one calling jitted functions) already traced for these
    shapes is traced again under `jax.disable_jit()`, its cache skipped.

    **Arguments:**

    - `fn`: a module (`Stacked`, `Chain`, `Recurrent`, `StackedMLP`, ...) or any
      function that calls one.
    - `*args`, `**kwargs`: example inputs (arrays or `jax.ShapeDtypeStruct`s).

    **Returns:**

    A list of [`AutoChoice`][eqxscan.remat.AutoChoice], one per scan in call order (one
    for a `Stacked`, one per scanned group of a `Chain`, two for a
    `Bidirectional`); empty when no scan used `"auto"`.
    """
    # Recorded in this context only: other threads and tasks are not seen.
    record: list[AutoChoice] = []
    with changed_call_state(auto_records=(*call_state().auto_records, record)):
        eqx.filter_eval_shape(fn, *args, **kwargs)
        if not record:  # a jit's cache may have skipped the trace
            with jax.disable_jit():
                eqx.filter_eval_shape(fn, *args, **kwargs)
    return record
