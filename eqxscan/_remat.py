"""`ScanCheckpoint`: what a scan keeps for the backward pass, beyond one policy.

A step's internals follow a `jax.checkpoint` policy; the carry a step receives and
its per-step inputs are named (`CARRY`, `INPUTS`) so that they can be saved,
recomputed or offloaded to host memory on their own; and the steps can be grouped
into nested levels of any shape (Flax's `remat_scan(lengths=...)`, Haliax's
`ScanCheckpointPolicy(nested=...)`).
"""

import dataclasses
import math
import operator
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.ad_checkpoint import checkpoint_name


#: The names a scan gives the carry each step receives and its per-step inputs,
#: for `jax.checkpoint_policies.save_only_these_names` and friends.
CARRY = "eqxscan.carry"
INPUTS = "eqxscan.inputs"
#: The carry at the start of a block of a nested scan.
BLOCK_CARRY = "eqxscan.block_carry"

Keep = bool | Literal["offload"]


def _check_keep(name: str, value: Any) -> None:
    if not any(value is v for v in (True, False)) and value != "offload":
        raise ValueError(
            f"ScanCheckpoint({name}=...) must be True (save), False (recompute) or "
            f"'offload' (save in pinned host memory), got {value!r}."
        )


def _check_nested(nested: Any) -> int | tuple[int, ...] | None:
    if nested is None:
        return None
    if isinstance(nested, tuple) and not isinstance(nested, bool):
        if len(nested) < 2 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in nested
        ):
            raise ValueError(
                "ScanCheckpoint(nested=(a, b, ...)) needs two or more positive int "
                f"lengths, outermost first, whose product is the scan length; got "
                f"{nested!r}."
            )
        return nested
    try:
        blocks = operator.index(nested)
    except TypeError:
        raise TypeError(
            "ScanCheckpoint(nested=...) must be None, a number of blocks (int) or a "
            f"tuple of lengths, got {type(nested).__name__} ({nested!r})."
        ) from None
    if isinstance(nested, bool) or blocks < 1:
        raise ValueError(
            f"ScanCheckpoint(nested=...) as a block count must be >= 1, got {nested!r}."
        )
    return blocks


@dataclasses.dataclass(frozen=True)
class ScanCheckpoint:
    """A `checkpoint=` value that also says what to do with each step's carry and
    inputs, and how to nest the scan.

    **Arguments:**

    - `policy`: the step's internals, as the plain `checkpoint=` options: `"auto"`
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
      saves them in pinned host memory.
    - `nested`: `None`, a number of blocks (a two-level scan: the outer level keeps
      one carry per block, the inner steps are recomputed), or a tuple of lengths
      `(a, b, ...)`, outermost first, whose product is the scan length (one level
      per entry).

    The carry and inputs are named `eqxscan.ScanCheckpoint.CARRY` and
    `eqxscan.ScanCheckpoint.INPUTS` inside the step, so a policy of your own can
    also refer to them.

    !!! example

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, eqxscan

        policy = eqxscan.ScanCheckpoint(policy=True, save_carries="offload")
        stack = eqxscan.Stacked(
            lambda k: eqx.nn.Linear(8, 8, key=k), 6, key=jax.random.key(0),
            checkpoint=policy,
        )
        grads = jax.grad(lambda s: jnp.sum(s(jnp.ones(8))))(stack)
        ```
    """

    policy: bool | Literal["auto"] | Callable = "auto"
    save_carries: Keep = True
    save_inputs: Keep = False
    nested: int | tuple[int, ...] | None = None

    CARRY = CARRY
    INPUTS = INPUTS

    def __post_init__(self) -> None:
        policy = self.policy
        if not (
            policy is True or policy is False or policy == "auto" or callable(policy)
        ):
            raise ValueError(
                "ScanCheckpoint(policy=...) must be 'auto', True, False or a "
                f"jax.checkpoint_policies policy, got {policy!r}."
            )
        _check_keep("save_carries", self.save_carries)
        _check_keep("save_inputs", self.save_inputs)
        object.__setattr__(self, "nested", _check_nested(self.nested))

    def levels(self, length: int) -> tuple[int, ...] | None:
        """The lengths of the outer levels of the nested scan over `length` steps,
        outermost first (the innermost level takes the rest); `None` for one flat
        scan. A block count that does not divide `length` leaves a remainder,
        run flat after the blocks."""
        nested = self.nested
        if nested is None:
            if self.save_carries is not False:
                return None
            return (length // sqrt_block(length),)
        if isinstance(nested, tuple):
            if math.prod(nested) != length:
                raise ValueError(
                    f"ScanCheckpoint(nested={nested}) has {math.prod(nested)} steps "
                    f"in all, but the scan has {length}; the lengths' product must "
                    "equal the number of layers (or time steps)."
                )
            return nested[:-1]
        return (min(nested, length),)

    def step_policy(self, base: Callable) -> Callable:
        """The innermost steps' policy: `base` for the internals, the `save_*`
        options for the named carry and inputs."""
        saved, offloaded = [], []
        for name, keep in ((CARRY, self.save_carries), (INPUTS, self.save_inputs)):
            if keep == "offload":
                offloaded.append(name)
            elif keep is True:
                saved.append(name)
        names = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=saved,
            names_which_can_be_offloaded=offloaded,
            offload_src="device",
            offload_dst="pinned_host",
        )

        def policy(prim: Any, *args: Any, **params: Any) -> Any:
            if params.get("name") in (CARRY, INPUTS) and str(prim) == "name":
                return names(prim, *args, **params)
            return base(prim, *args, **params)

        return policy

    def boundary_policy(self) -> Callable:
        """The outer levels' policy: only the block-boundary carry may be kept
        (offloaded with `save_carries="offload"`); everything else is recomputed."""
        offload = [BLOCK_CARRY] if self.save_carries == "offload" else []
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=offload,
            offload_src="device",
            offload_dst="pinned_host",
        )


def sqrt_block(length: int) -> int:
    """Steps per block of a two-level scan: a divisor of `length` near its square
    root when there is one (reshaping `[L, ...]` to `[L/b, b, ...]` is free, while
    splitting off a remainder copies the stacked weights), else `ceil(sqrt(L))`."""
    if length <= 1:
        return 1
    root = math.sqrt(length)
    divisors = [d for d in range(1, length + 1) if length % d == 0]
    best = min(divisors, key=lambda d: (d + length // d, -d))
    if best + length // best <= 3 * root:
        return best
    return math.isqrt(length - 1) + 1


def name_tree(tree: Any, name: str) -> Any:
    """Every array leaf of `tree` named `name` for the checkpoint policies (PRNG
    keys excepted: they are cheap to keep and cannot be offloaded)."""

    def one(a: Any) -> Any:
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            return a
        return checkpoint_name(a, name)

    return jtu.tree_map(one, tree)


def name_inputs(tree: Any, checkpoint: Any) -> Any:
    """A step's inputs, named `INPUTS` when `checkpoint` is a `ScanCheckpoint`
    (and left alone otherwise, so other programs do not change)."""
    if not isinstance(checkpoint, ScanCheckpoint):
        return tree
    return name_tree(tree, INPUTS)


def nested_scan(
    body: Callable,
    carry: Any,
    xs: Any,
    length: int,
    levels: tuple[int, ...],
    unroll: Any,
    step_policy: Callable | None,
    boundary_policy: Callable | None,
    reverse: bool = False,
) -> tuple[Any, Any]:
    """`lax.scan(body, carry, xs, reverse=reverse)` as nested scans: `levels` are
    the lengths of the outer levels (outermost first); the innermost level takes
    the rest. Each outer level's body is checkpointed, so only its carries are
    kept and the steps inside are recomputed in the backward pass. Reversed, every
    level runs backwards, so `xs` is read in place rather than flipped."""
    step = jax.checkpoint(body, policy=step_policy, prevent_cse=False)
    if not levels:
        return jax.lax.scan(
            step, carry, xs, length=length, unroll=unroll, reverse=reverse
        )
    outer, inner_levels = levels[0], levels[1:]
    inner = length // outer
    head = outer * inner

    def block(c: Any, xs_block: Any) -> tuple[Any, Any]:
        c = name_tree(c, BLOCK_CARRY)
        return nested_scan(
            body,
            c,
            xs_block,
            inner,
            inner_levels,
            unroll,
            step_policy,
            boundary_policy,
            reverse,
        )

    def blocks(carry: Any) -> tuple[Any, Any]:
        split = jtu.tree_map(lambda a: a[:head].reshape(outer, inner, *a.shape[1:]), xs)
        carry, ys = jax.lax.scan(
            jax.checkpoint(block, policy=boundary_policy, prevent_cse=False),
            carry,
            split,
            length=outer,
            reverse=reverse,
        )
        return carry, jtu.tree_map(lambda a: a.reshape(head, *a.shape[2:]), ys)

    def rest(carry: Any) -> tuple[Any, Any]:
        tail = jtu.tree_map(lambda a: a[head:], xs)
        return jax.lax.scan(
            step, carry, tail, length=length - head, unroll=unroll, reverse=reverse
        )

    if head == length:
        return blocks(carry)
    # The remainder comes last in consumption order.
    if reverse:
        carry, ys_tail = rest(carry)
        carry, ys = blocks(carry)
    else:
        carry, ys = blocks(carry)
        carry, ys_tail = rest(carry)
    return carry, jtu.tree_map(lambda a, b: jnp.concatenate([a, b]), ys, ys_tail)
