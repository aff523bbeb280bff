"""`ScanRemat`: what a scan keeps for the backward pass. A step's internals
follow a `jax.checkpoint` policy; its carry and inputs are named (`CARRY`,
`INPUTS`) to be saved, recomputed or offloaded on their own; the steps nest into
levels of any shape (Flax's `remat_scan(lengths=...)`)."""

import dataclasses
import math
import operator
import warnings
from collections.abc import Callable
from typing import Literal, TypeAlias, TypeVar

import jax
import jax.core
import jax.extend.core as jcore
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.ad_checkpoint import checkpoint_name, Offloadable, Recompute, Saveable
from jaxtyping import PyTree

from .._helpers import checks


#: The names a scan gives the carry each step receives and its per-step inputs,
#: for `jax.checkpoint_policies.save_only_these_names` and friends.
CARRY = "eqxscan.carry"
INPUTS = "eqxscan.inputs"
#: The carry at the start of a block of a nested scan.
BLOCK_CARRY = "eqxscan.block_carry"
#: A layer's read of its slice of an `eqxscan.buffer`: every policy saves it, so
#: the backward pass keeps each layer's slice rather than the whole stacked
#: buffer that travels in the carry.
BUFFER_READ = "eqxscan.buffer_read"


_DOTS = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def matmul_policy(prim: object, *avals: jax.core.ShapedArray, **params: object) -> bool:
    """The matmul-saving policy: save the weight products, recompute the
    elementwise work. One of `remat="auto"`'s choices, and what `"auto"` means
    as the `policy` of a `ScanRemat` that names or nests.

    It is `jax.checkpoint_policies.dots_with_no_batch_dims_saveable` that also
    saves what puts those products in the layout their backward readers want:
    transposes of arrays of 3 or more axes (`eqx.nn.Linear` under `jax.vmap`
    computes `W @ x`, then moves the batch axes to the front) and reshapes to 4
    or more axes (attention's split into heads under a batch `vmap`). A stacked
    residual has one layout; saved before these, each layer's was copied into
    another in the backward pass (on a TPU v5e, a Transformer of 16 layers:
    322 ms a step against 363, no per-layer copy but a weight's). 2-D
    transposes and reshapes to 3 axes are not saved: those are most often of
    weights, which each step already has.
    """
    if prim is jax.lax.transpose_p:
        return avals[0].ndim >= 3
    if prim is jax.lax.reshape_p:
        return len(params["new_sizes"]) >= 4  # pyright: ignore[reportArgumentType]  # a tuple
    return _DOTS(prim, *avals, **params)


#: What `remat="offload"` means: the matmul outputs `matmul_policy` keeps (not
#: its transposes and reshapes), in pinned host memory (on CPU, where both are one, the
#: program matches that of the matmul outputs saved).
OFFLOAD_POLICY = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
    "device", "pinned_host"
)

Policy: TypeAlias = Callable[..., bool]

SAVE_BUFFER_READS: Policy = jax.checkpoint_policies.save_only_these_names(BUFFER_READ)
Keep: TypeAlias = bool | Literal["offload"] | None


def check_policy(name: str, policy: Callable[..., object]) -> None:
    """A `TypeError` unless `policy(primitive, *avals)` answers as JAX needs
    (else `len`, or an uncalled factory, would fail only under `grad`)."""
    aval = jax.core.ShapedArray((), jnp.float32)
    not_policy = f"{name}={checks.describe(policy)} is not a rematerialisation policy"
    try:
        answer = policy(jax.lax.mul_p, aval, aval)
    except Exception as e:
        raise TypeError(
            f"{not_policy}: called as JAX calls one, policy(primitive, *avals, "
            f"**params), it raised {type(e).__name__}: {e}\nHint: pass a "
            "jax.checkpoint_policies policy (e.g. jax.checkpoint_policies."
            "dots_saveable), True, False, 'auto', 'nested', 'offload' or an "
            "eqxscan.ScanRemat."
        ) from None
    if not isinstance(answer, (bool, type(Recompute), type(Saveable), Offloadable)):
        raise TypeError(
            f"{not_policy}: policy(primitive, *avals) answered "
            f"{checks.describe(answer)}, not a bool, Recompute, Saveable or "
            "Offloadable.\nHint: a policy answers True (save) or False (recompute); "
            "call a factory first, e.g. jax.checkpoint_policies."
            f"save_only_these_names('name'). See {checks.docs('remat.md')}."
        )


def _as_index(n: object) -> int | None:
    try:
        return operator.index(n)  # pyright: ignore[reportArgumentType]  # None is the check
    except TypeError:
        return None


@dataclasses.dataclass(frozen=True)
class ScanRemat:
    """A `remat=` value that also says what to do with each step's carry and
    inputs, and how to nest the scan.

    **Arguments:**

    - `policy`: the step's internals, as the plain `remat=` options: `"auto"`
      (default), `True` (recompute everything), `False` (save everything) or a
      `jax.checkpoint_policies` policy.
    - `save_carries`: the carry each step receives. `True` (default) keeps it, as
      any scan does; `"offload"` keeps it in pinned host memory; `False`
      recomputes it from the carry at the start of its block, which needs nested
      blocks (with `nested=None`, about `sqrt(L)` blocks are used).
    - `save_inputs`: each step's slice of the scanned inputs (a layer's weights,
      after the `layer_sharding` constraint, and its `per_layer` arguments; a
      time step's inputs). `False` (default) reads them again in the backward
      pass (re-gathering FSDP-sharded weights); `True` saves them; `"offload"`
      saves them in pinned host memory. `None` (for either) leaves the value
      unnamed: the policy alone decides, as for a plain `remat=` value.
    - `nested`: `None`, a number of blocks (a two-level scan: the outer level
      keeps one carry per block, the inner steps are recomputed), or a tuple of
      lengths `(a, b, ...)`, outermost first, whose product is the scan length.
      Any nesting applies whatever `save_carries` and `save_inputs` say.

    Every `remat=` value is one of these (`ScanOptions.scan_remat`): `False`,
    `True`, a policy and `"offload"` are `ScanRemat(policy=...,
    save_carries=None, save_inputs=None)`; `"auto"` the same with
    `policy="auto"` (eqxscan's rule for a flat scan that names nothing, else
    the matmul-saving policy); `"nested"` is `ScanRemat(save_carries=False,
    save_inputs=None)`. Inside the step the carry and inputs are named
    `eqxscan.ScanRemat.CARRY` and `eqxscan.ScanRemat.INPUTS`, for policies of
    your own.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        policy = eqxscan.ScanRemat(policy=True, save_carries="offload")
        stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(8, 8, key=k), 6, key=jax.random.key(0),
            remat=policy,
        )
        grads = jax.grad(lambda s: jnp.sum(s(jnp.ones(8))))(stack)
        ```
    """

    policy: bool | Literal["auto"] | Policy = "auto"
    save_carries: Keep = True
    save_inputs: Keep = False
    nested: int | tuple[int, ...] | None = None
    # Set by `kept_on_device`: called when a gradient reads the step's policy.
    _consulted: Callable[[], None] | None = dataclasses.field(
        default=None, init=False, compare=False, repr=False
    )

    CARRY = CARRY
    INPUTS = INPUTS

    def __post_init__(self) -> None:
        policy = self.policy
        if callable(policy):
            check_policy("ScanRemat: policy", policy)
        elif not (policy is True or policy is False or policy == "auto"):
            raise ValueError(
                "ScanRemat(policy=...) must be 'auto', True, False or a "
                f"jax.checkpoint_policies policy, got {policy!r}."
            )
        for name in ("save_carries", "save_inputs"):
            keep = getattr(self, name)
            if not (keep is None or keep is True or keep is False or keep == "offload"):
                raise ValueError(
                    f"ScanRemat({name}=...) must be True (save), False (recompute), "
                    f"'offload' (save in pinned host memory) or None (not named: the "
                    f"policy decides), got {keep!r}."
                )
        nested = self.nested
        if isinstance(nested, tuple):
            lengths = [
                None if isinstance(n, bool | np.bool_) else _as_index(n) for n in nested
            ]
            if len(nested) < 2 or not all(n is not None and n >= 1 for n in lengths):
                raise ValueError(
                    "ScanRemat(nested=(a, b, ...)) needs two or more positive int "
                    "lengths, outermost first, whose product is the scan length; "
                    f"got {nested!r}."
                )
            object.__setattr__(self, "nested", tuple(lengths))  # NumPy ints as ints
        elif nested is not None:
            is_bool = isinstance(nested, bool | np.bool_)
            blocks = None if is_bool else _as_index(nested)
            if blocks is None:
                got = "the bool" if is_bool else f"{type(nested).__name__}"
                raise TypeError(
                    "ScanRemat(nested=...) must be None, a number of blocks (int) "
                    f"or a tuple of lengths, got {got} ({nested!r})."
                )
            if blocks < 1:
                raise ValueError(
                    "ScanRemat(nested=...) as a block count must be >= 1, got "
                    f"{nested!r}."
                )
            object.__setattr__(self, "nested", blocks)

    @property
    def named(self) -> bool:
        """Whether the carry or inputs are named, or the scan nests (else the
        value behaves as a plain `remat=` value)."""
        return (self.save_carries, self.save_inputs, self.nested) != (None,) * 3

    @property
    def is_rule(self) -> bool:
        """Whether eqxscan's `"auto"` rule chooses (`remat="auto"`): policy
        `"auto"` on a flat scan that names nothing."""
        return self.policy == "auto" and not self.named

    def base_policy(self) -> Policy:
        """The `jax.checkpoint_policies` policy of the step's internals (a
        layer's read of its buffer slice is saved whatever it says)."""
        if self.policy is True:
            return SAVE_BUFFER_READS
        if self.policy is False:
            return jax.checkpoint_policies.everything_saveable
        policy = matmul_policy if isinstance(self.policy, str) else self.policy
        return _by_name((BUFFER_READ,), lambda *a, **p: True, policy)

    def levels(self, length: int, where: str = "") -> tuple[int, ...] | None:
        """The lengths of the outer levels of the nested scan over `length` steps,
        outermost first (the innermost level takes the rest); `None` for one flat
        scan. A block count that does not divide `length` leaves a remainder,
        run flat after the blocks. `where` names the scan in errors."""
        nested = self.nested
        if nested is None:
            if self.save_carries is not False:
                return None
            return (length // sqrt_block(length),)
        if isinstance(nested, tuple):
            if math.prod(nested) != length:
                raise ValueError(
                    (f"{where}: " if where else "")
                    + f"ScanRemat(nested={nested}) has {math.prod(nested)} steps "
                    f"in all, but the scan has {length}; the lengths' product must "
                    "equal the number of layers (or time steps).\nHint: a Chain's "
                    "scanned groups, and stacks inside layers, each have their own "
                    "length; a block count, ScanRemat(nested=k), fits any. See "
                    f"{checks.docs('remat.md')}."
                )
            return nested[:-1]
        return (min(nested, length),)

    def step_policy(self) -> Policy:
        """The innermost steps' policy: `base_policy` for the internals, the
        `save_*` options for the named carry and inputs."""
        if not self.named:
            return self.base_policy()
        keeps = {CARRY: self.save_carries, INPUTS: self.save_inputs}
        names = _names_policy(
            [n for n, k in keeps.items() if k is True],
            [n for n, k in keeps.items() if k == "offload"],
        )
        policy = _by_name(tuple(keeps), names, self.base_policy())
        consulted = self._consulted
        if consulted is None:
            return policy

        def announced(*args: object, **params: object) -> object:
            consulted()
            return policy(*args, **params)

        return announced  # pyright: ignore[reportReturnType]  # the policy's answers


def _names_policy(saved: list[str], offloaded: list[str]) -> Policy:
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=saved,
        names_which_can_be_offloaded=offloaded,
        offload_src="device",
        offload_dst="pinned_host",
    )


def _by_name(names: tuple[str, ...], named: Policy, base: Policy) -> Policy:
    # `named` for the values named `names`, else `base` (an offloading policy's
    # answers are not bools, so `save_from_both_policies` cannot combine them).
    def policy(prim: object, *args: object, **params: object) -> object:
        if params.get("name") in names and str(prim) == "name":
            return named(prim, *args, **params)
        return base(prim, *args, **params)

    return policy  # pyright: ignore[reportReturnType]  # offloading answers are not bools


def on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


def staged() -> bool:
    """Whether a staging trace (`jit`, `scan`, `checkpoint`) is current: under
    one a new value is a tracer; called eagerly, or under an eager `grad` or
    `vmap`, it is not."""
    return isinstance(jnp.zeros(()), jax.core.Tracer)


def offloads_between_programs(remat: ScanRemat) -> bool:
    """Whether an eager gradient with `remat` would pass residuals in host
    memory from one program to another (see `kept_on_device`)."""
    keeps = (remat.save_carries, remat.save_inputs)
    return on_accelerator() and ("offload" in keeps or callable(remat.policy))


def kept_on_device(remat: ScanRemat) -> ScanRemat:
    """`remat` with every residual it would offload saved in device memory
    instead, and a warning, where the offloaded copies would pass between
    programs: a call outside `jax.jit` on an accelerator, whose backward pass
    runs as programs of its own (on a TPU v5e, JAX 0.10.2, an eager gradient
    read such copies wrong, see docs/remat.md). Under `jax.jit` (or any staging
    trace) and on CPU, `remat` as it is."""
    if not offloads_between_programs(remat) or staged():
        return remat  # one memory, or one program (a staging trace)
    warned: list[bool] = []

    def warn() -> None:
        if not warned:
            warned.append(True)
            warnings.warn(
                "remat offloads residuals to host memory, but this call runs "
                f"outside jax.jit on {jax.default_backend()}, where they would pass "
                "between programs; they are kept in device memory instead.\nHint: "
                f"jit the step (eqx.filter_jit) to offload. See "
                f"{checks.docs('remat.md')}.",
                stacklevel=3,
            )

    policy = remat.policy
    if callable(policy):  # a user's own may offload: read its answers
        policy = _saving_offloads(policy, warn)
    on_device = lambda keep: True if keep == "offload" else keep  # noqa: E731
    kept = dataclasses.replace(
        remat,
        policy=policy,
        save_carries=on_device(remat.save_carries),
        save_inputs=on_device(remat.save_inputs),
    )
    # Warned of when a gradient reads the policy.
    if "offload" in (remat.save_carries, remat.save_inputs):
        object.__setattr__(kept, "_consulted", warn)
    return kept


def _saving_offloads(user: Policy, warn: Callable[[], None]) -> Policy:
    def policy(prim: object, *args: object, **params: object) -> object:
        answer = user(prim, *args, **params)
        if isinstance(answer, Offloadable):
            warn()
            return Saveable
        return answer

    return policy  # pyright: ignore[reportReturnType]  # Saveable is not a bool


def as_scan_remat(remat: object) -> ScanRemat:
    """A `remat=` value, checked, as the one `ScanRemat` the engine reads (see
    `ScanRemat`'s docstring for the correspondence)."""
    if isinstance(remat, ScanRemat):
        return remat
    if isinstance(remat, np.bool_):  # NumPy's bool, as from a config array
        remat = bool(remat)
    if isinstance(remat, type):  # the class, uncalled: ScanRemat, say
        raise TypeError(
            f"remat={remat.__name__}, a class, is not a remat= value.\nHint: pass "
            f"an instance, {remat.__name__}(...), or False, True, 'auto', "
            "'nested', 'offload' or a jax.checkpoint_policies policy."
        )
    if callable(remat):
        check_policy("remat", remat)
    elif isinstance(remat, str):
        checks.check_option("remat", remat, (False, True, "auto", "nested", "offload"))
    elif not isinstance(remat, bool):
        raise TypeError(
            "remat must be False, True, 'auto', 'nested', 'offload', a "
            "jax.checkpoint_policies policy or an eqxscan.ScanRemat, got "
            f"{type(remat).__name__}."
        )
    if remat == "nested":
        return ScanRemat(save_carries=False, save_inputs=None)
    policy = OFFLOAD_POLICY if remat == "offload" else remat
    return ScanRemat(policy, save_carries=None, save_inputs=None)  # type: ignore[arg-type]  # a checked remat= value


def sqrt_block(length: int) -> int:
    """Steps per block of a two-level scan: a divisor of `length` near its square
    root when there is one (reshaping `[L, ...]` to `[L/b, b, ...]` is free, while
    splitting off a remainder copies the stacked weights), else `ceil(sqrt(L))`."""
    if length <= 1:
        return 1
    divisors = [d for d in range(1, length + 1) if length % d == 0]
    best = min(divisors, key=lambda d: (d + length // d, -d))
    if best + length // best <= 3 * math.sqrt(length):
        return best
    return math.isqrt(length - 1) + 1


T = TypeVar("T")


def name_tree(tree: T, name: str) -> T:
    """Every array leaf of `tree` named `name` for the remat policies, but PRNG
    keys (cheap to keep, and they cannot be offloaded)."""

    def one(a: object) -> object:
        if not isinstance(a, jax.Array) or jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            return a
        return checkpoint_name(a, name)

    return jtu.tree_map(one, tree)


def name_inputs(tree: T, remat: ScanRemat) -> T:
    """A step's inputs, named `INPUTS` when `remat` names them."""
    return tree if remat.save_inputs is None else name_tree(tree, INPUTS)


Step: TypeAlias = Callable[[PyTree, PyTree], tuple[PyTree, PyTree]]


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
    """A step traced once: `jaxpr` maps the flat leaves of `(carry, x)` (array
    leaves only) to those of `(carry, y)`; `y_static` is the non-array part of
    `y`, the same at every step."""

    jaxpr: jcore.ClosedJaxpr
    out_tree: jtu.PyTreeDef  # pyright: ignore[reportInvalidTypeForm]  # jax's stubs declare PyTreeDef a variable
    y_static: PyTree
    n_carry: int

    def __call__(self, c_dyn: PyTree, x: PyTree) -> tuple[PyTree, PyTree]:
        """Evaluate the traced step (no Python code of the step runs)."""
        out = jcore.jaxpr_as_fun(self.jaxpr)(*jtu.tree_leaves((c_dyn, x)))
        return jtu.tree_unflatten(self.out_tree, out)


def nested_scan(
    step: Step,
    carry: PyTree,
    xs: PyTree,
    length: int,
    remat: ScanRemat,
    unroll: int | bool,
    reverse: bool = False,
    where: str = "",
) -> tuple[PyTree, PyTree]:
    """`lax.scan(step, carry, xs, reverse=reverse)` as the nested scans of
    `remat.levels` (one flat scan for none). Each outer level's body keeps
    only its carries, offloaded with `save_carries="offload"`, and recomputes
    the rest. Reversed, every level runs backwards, so `xs` is read in place
    rather than flipped."""
    offloaded = [BLOCK_CARRY] if remat.save_carries == "offload" else []
    boundary_policy = _names_policy([], offloaded)

    def scan(
        carry: PyTree, xs: PyTree, length: int, levels: tuple[int, ...]
    ) -> tuple[PyTree, PyTree]:
        if not levels:
            return jax.lax.scan(
                step, carry, xs, length=length, unroll=unroll, reverse=reverse
            )
        outer, inner = levels[0], length // levels[0]
        head = outer * inner

        def block(c: PyTree, xs_block: PyTree) -> tuple[PyTree, PyTree]:
            return scan(name_tree(c, BLOCK_CARRY), xs_block, inner, levels[1:])

        def blocks(carry: PyTree) -> tuple[PyTree, PyTree]:
            split = jtu.tree_map(
                lambda a: a[:head].reshape(outer, inner, *a.shape[1:]), xs
            )
            carry, ys = jax.lax.scan(
                jax.checkpoint(block, policy=boundary_policy, prevent_cse=False),
                carry,
                split,
                length=outer,
                reverse=reverse,
            )
            return carry, jtu.tree_map(lambda a: a.reshape(head, *a.shape[2:]), ys)

        if head == length:
            return blocks(carry)
        tail = jtu.tree_map(lambda a: a[head:], xs)
        # The remainder comes last in consumption order.
        if reverse:
            carry, ys_tail = scan(carry, tail, length - head, ())
            carry, ys = blocks(carry)
        else:
            carry, ys = blocks(carry)
            carry, ys_tail = scan(carry, tail, length - head, ())
        return carry, jtu.tree_map(lambda a, b: jnp.concatenate([a, b]), ys, ys_tail)

    return scan(carry, xs, length, remat.levels(length, where) or ())
