"""Name maps: eqxscan's per-layer names to another convention's, used both ways.

A rule maps one or more of eqxscan's name patterns (`{i}`: the layer index as
[`eqxscan.to_state_dict`][] writes it) to one or more external names through
array operations applied in order on export (`Join`, `Reshape`, `Transpose`,
`Split`); loading inverts them, with the shapes `like` gives.
"""

import collections
import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._internal import check_like, describe
from ._files import cast_hint, Lazy, listed, shape_dtype, spec
from ._state_dict import entries_of, from_state_dict, host_entries


T = TypeVar("T")
Shape = tuple[int, ...]
_PLACEHOLDER = re.compile(r"\{([A-Za-z_]\w*)\}")
_LAYOUTS = ("pt", "flax", "tf")  # as Hugging Face names the frameworks


# Each operation maps a list of arrays to another (one array but after a `Join`
# or before a `Split`): `shapes` on shapes alone, `apply` on export, `invert` on
# loading, given the shapes before it.


def _axis(op: str, axis: int, shape: Shape) -> int:
    # An axis the shape does not have is refused, not wrapped around.
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"{op} has no axis {axis} in shape {list(shape)}")
    return axis % len(shape)


@dataclasses.dataclass(frozen=True)
class Transpose:
    """Permute the axes (`axes=None` reverses them: `[in, out]` <-> `[out, in]`)."""

    axes: tuple[int, ...] | None = None

    def _axes(self, ndim: int) -> tuple[int, ...]:
        axes = tuple(reversed(range(ndim))) if self.axes is None else self.axes
        # An axis the array lacks is refused, not wrapped around (2 taken as 0).
        wrapped = tuple(a % ndim if -ndim <= a < ndim else -1 for a in axes)
        if sorted(wrapped) != list(range(ndim)):
            raise ValueError(f"Transpose{axes} does not permute {ndim} axes")
        return wrapped

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        return [tuple(shapes[0][a] for a in self._axes(len(shapes[0])))]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.transpose(arrays[0], self._axes(arrays[0].ndim))]

    def invert(self, arrays: list[np.ndarray], _: list[Shape]) -> list[np.ndarray]:
        return [np.transpose(arrays[0], np.argsort(self._axes(arrays[0].ndim)))]


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Reshape (one `-1` allowed), e.g. the head axes `[H, hd, D]` <-> `[H*hd, D]`."""

    to: tuple[int, ...]

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        size = int(np.prod(shapes[0], dtype=np.int64))
        known = int(np.prod([d for d in self.to if d != -1], dtype=np.int64))
        if (
            self.to.count(-1) > 1
            or min(self.to, default=0) < -1
            or ((size != known) if -1 not in self.to else (known == 0 or size % known))
        ):
            raise ValueError(f"Reshape{self.to} does not fit shape {list(shapes[0])}")
        return [tuple(size // known if d == -1 else d for d in self.to)]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [arrays[0].reshape(self.to)]

    def invert(self, arrays: list[np.ndarray], before: list[Shape]) -> list[np.ndarray]:
        return [arrays[0].reshape(before[0])]


@dataclasses.dataclass(frozen=True)
class Split:
    """The last operation of a rule with several external names: cut along
    `axis` into pieces of `sizes` (e.g. a fused `wqkv` into q/k/v projections;
    with grouped-query heads `sizes=(H*hd, K*hd, K*hd)`)."""

    axis: int
    sizes: tuple[int, ...]

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        (shape,) = shapes
        ax = _axis(f"Split({self.axis}, {self.sizes})", self.axis, shape)
        if sum(self.sizes) != shape[ax] or min(self.sizes) < 0:
            raise ValueError(
                f"Split({self.axis}, {self.sizes}) does not fit shape {list(shape)}"
            )
        return [shape[:ax] + (n,) + shape[ax + 1 :] for n in self.sizes]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return np.split(arrays[0], np.cumsum(self.sizes)[:-1], axis=self.axis)

    def invert(self, arrays: list[np.ndarray], _: list[Shape]) -> list[np.ndarray]:
        return [np.concatenate(arrays, axis=self.axis)]


@dataclasses.dataclass(frozen=True)
class Join:
    """The first operation of a rule with several of eqxscan's names:
    concatenate them along `axis` (loading cuts them apart again, with the
    sizes `like` gives)."""

    axis: int

    def shapes(self, shapes: list[Shape]) -> list[Shape]:
        first = shapes[0]
        ax = _axis(f"Join({self.axis})", self.axis, first)
        if any(
            len(s) != len(first) or s[:ax] + s[ax + 1 :] != first[:ax] + first[ax + 1 :]
            for s in shapes
        ):
            raise ValueError(
                f"Join({self.axis}) cannot join shapes {[list(s) for s in shapes]}"
            )
        return [first[:ax] + (sum(s[ax] for s in shapes),) + first[ax + 1 :]]

    def apply(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.concatenate(arrays, axis=self.axis)]

    def invert(self, arrays: list[np.ndarray], before: list[Shape]) -> list[np.ndarray]:
        ax = self.axis % len(before[0])
        return np.split(arrays[0], np.cumsum([s[ax] for s in before])[:-1], axis=ax)


_Op = Transpose | Reshape | Split | Join


@dataclasses.dataclass(frozen=True)
class Rule:
    """External name(s) for a [`eqxscan.checkpoint.NameMap`][] entry, and the
    operations, in export order, that make them.

    **Arguments:**

    - `theirs`: an external name pattern, or a tuple of them (then the last
      operation is a `Split` with one size per name).
    - `ops`: `Join(axis)` (first, when the entry's key is a tuple of eqxscan
      names), `Reshape(shape)`, `Transpose(axes)`, `Split(axis, sizes)` (last).
    """

    theirs: tuple[str, ...]
    ops: tuple[_Op, ...] = ()

    def __init__(self, theirs: str | Sequence[str], *ops: _Op):
        names = (theirs,) if isinstance(theirs, str) else tuple(theirs)
        object.__setattr__(self, "theirs", names)
        object.__setattr__(self, "ops", ops)


def _compile(pattern: str, where: str) -> tuple[re.Pattern[str], tuple[str, ...]]:
    keys = tuple(_PLACEHOLDER.findall(pattern))
    if len(set(keys)) != len(keys):
        raise ValueError(f"{where}: '{pattern}' repeats a placeholder")
    pieces = _PLACEHOLDER.split(pattern)
    regex = "".join(
        rf"(?P<{p}>\d+)" if k % 2 else re.escape(p) for k, p in enumerate(pieces)
    )
    return re.compile(regex), keys


def _where(binding: Mapping[str, int]) -> str:
    if len(binding) == 1:
        return f" (layer {_layer(binding)})"
    return f" ({', '.join(f'{k}={v}' for k, v in binding.items())})" if binding else ""


def _layer(binding: Mapping[str, int]) -> int:
    # The layer of a binding of one placeholder; -1 (every depth has it) if none.
    return next(iter(binding.values())) if len(binding) == 1 else -1


class _Compiled:
    def __init__(self, ours: tuple[str, ...], rule: Rule, where: str):
        self.ours, self.rule = ours, rule
        if len(set(ours)) != len(ours):  # a Join would take one array twice
            raise ValueError(f"{where}: it joins {list(ours)}, a name twice")
        compiled = [_compile(p, where) for p in ours + rule.theirs]
        self.ours_regex = [regex for regex, _ in compiled[: len(ours)]]
        self.theirs_regex = [regex for regex, _ in compiled[len(ours) :]]
        first = sorted(compiled[0][1])  # a pattern names each placeholder once
        for pattern, (_, keys) in zip(ours + rule.theirs, compiled):
            if sorted(keys) != first:
                raise ValueError(
                    f"{where}: '{pattern}' has placeholders {sorted(keys)}, the rule "
                    f"{first}; every name of a rule needs the same ones."
                )
        ops, n_ours, n_theirs = rule.ops, len(ours), len(rule.theirs)
        joins = [k for k, op in enumerate(ops) if isinstance(op, Join)]
        splits = [k for k, op in enumerate(ops) if isinstance(op, Split)]
        if joins != ([0] if n_ours > 1 else []):
            need = "a Join as its first operation" if n_ours > 1 else "no Join"
            raise ValueError(
                f"{where}: a rule from {n_ours} eqxscan names needs {need}"
            )
        if splits != ([len(ops) - 1] if n_theirs > 1 else []):
            need = "a Split as its last operation" if n_theirs > 1 else "no Split"
            raise ValueError(
                f"{where}: a rule to {n_theirs} external names needs {need}"
            )
        if ops and isinstance(last := ops[-1], Split) and len(last.sizes) != n_theirs:
            raise ValueError(
                f"{where}: Split{last.sizes} gives {len(last.sizes)} pieces for "
                f"{n_theirs} external names"
            )

    def shapes(self, shapes: Sequence[Shape]) -> list[list[Shape]]:
        # The shapes after each operation, starting from eqxscan's (export order).
        steps = [list(shapes)]
        for op in self.rule.ops:
            steps.append(op.shapes(steps[-1]))
        return steps

    def export(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        for op in self.rule.ops:
            arrays = op.apply(arrays)
        return [np.ascontiguousarray(a) for a in arrays]

    def load(
        self, arrays: list[np.ndarray], steps: list[list[Shape]]
    ) -> list[np.ndarray]:
        for op, before in reversed(list(zip(self.rule.ops, steps))):
            arrays = op.invert(arrays, before)
        return [np.ascontiguousarray(a) for a in arrays]


class NameMap:
    """How eqxscan's per-layer names ([`eqxscan.to_state_dict`][]) map to an
    external convention's, used both ways: [`eqxscan.save_safetensors`][] and
    `export` write the external names, [`eqxscan.load_safetensors`][] and
    `load` read them into a model.

    !!! example

        ```python
        import jax, numpy as np, eqxscan
        from eqxscan.checkpoint import NameMap, Rule, Transpose

        model = eqxscan.Stacked(
            lambda k: eqxscan.MLPBlock(4, key=k), 2, key=jax.random.key(0)
        )
        names = NameMap(
            {
                "{i}.w1": Rule("layers.{i}.up.weight", Transpose()),
                "{i}.w2": Rule("layers.{i}.down.weight", Transpose()),
                "{i}.scale": "layers.{i}.norm.weight",
            },
            ignore=["layers.{i}.rotary.inv_freq"],
        )
        external = names.export(model)
        assert external["layers.1.up.weight"].shape == (16, 4)  # [out, in]
        np.testing.assert_array_equal(external["layers.1.up.weight"], model[1].w1.T)
        external["layers.0.rotary.inv_freq"] = np.ones(2, np.float32)  # ignored
        assert eqxscan.to_state_dict(names.load(model, external)).keys() == (
            eqxscan.to_state_dict(model).keys()
        )
        ```

    **Arguments:**

    - `rules`: maps each eqxscan name pattern (or a tuple of them, joined) to an
      external name pattern or a [`eqxscan.checkpoint.Rule`][]. Placeholders
      such as `{i}` stand for a layer index; both sides of a rule use the same
      ones. The first rule whose pattern matches a name is used.
    - `ignore`: external name patterns of their side only (rotary buffers, a
      tied head's copy of the embedding): skipped when loading, never written
      (a rule that makes one is refused).
    - `keep`: eqxscan name patterns of this side only: loading keeps `like`'s
      arrays, exporting leaves them out.
    - `format`: the `format` entry of a safetensors file's metadata (`"pt"` for
      PyTorch names, `"flax"` for Flax names, as Hugging Face reads them).
    """

    def __init__(
        self,
        rules: Mapping[str | tuple[str, ...], str | Rule],
        *,
        ignore: Sequence[str] = (),
        keep: Sequence[str] = (),
        format: str = "pt",
    ):
        # One of these in another case would lift the check of a file's format.
        if format not in _LAYOUTS and str(format).lower() in _LAYOUTS:
            raise ValueError(
                f"NameMap: format {format!r} is not a layout's name; the check of a "
                f"file's format would not apply.\nHint: pass format="
                f"{str(format).lower()!r}, as Hugging Face writes it."
            )
        self.format = format
        self._rules: list[_Compiled] = []
        for k, (ours, rule) in enumerate(rules.items()):
            ours = (ours,) if isinstance(ours, str) else tuple(ours)
            rule = Rule(rule) if isinstance(rule, str) else rule
            if not isinstance(rule, Rule):
                raise TypeError(
                    f"NameMap: rules[{ours!r}] must be an external name (str) "
                    f"or an eqxscan.checkpoint.Rule, got {describe(rule)}."
                )
            self._rules.append(_Compiled(ours, rule, f"NameMap rule {k} ({ours[0]!r})"))
        # One pattern as a string, not its characters (each would match nothing).
        ignore, keep = ([x] if isinstance(x, str) else x for x in (ignore, keep))
        self._ignore = [_compile(p, "NameMap ignore")[0] for p in ignore]
        self._keep = [_compile(p, "NameMap keep")[0] for p in keep]

    # Planning: which rule makes which names, from shapes alone.

    def _plan(
        self, layout: Mapping[str, tuple[Shape, np.dtype]]
    ) -> tuple[list["_Planned"], list[str]]:
        # Each rule applied, with its names and shapes, in `layout`'s order; and
        # the names kept from `like`.
        used: set[str] = set()
        planned: list[_Planned] = []
        kept, unmapped, incomplete, bad = [], [], [], []
        for name in layout:
            if name in used:
                continue
            if any(r.fullmatch(name) for r in self._keep):
                kept.append(name)
                continue
            for rule in self._rules:
                match = next(
                    (m for r in rule.ours_regex if (m := r.fullmatch(name))), None
                )
                if match is None:
                    continue
                binding = {k: int(v) for k, v in match.groupdict().items()}
                ours = tuple(p.format(**binding) for p in rule.ours)
                if absent := [n for n in ours if n not in layout or n in used]:
                    incomplete.append(f"'{name}' needs {', '.join(map(repr, absent))}")
                    break
                used.update(ours)
                try:
                    dtypes = {layout[n][1] for n in ours}
                    if len(dtypes) > 1:
                        names = sorted(d.name for d in dtypes)
                        raise ValueError(f"Join of dtypes {names}")
                    steps = rule.shapes([layout[n][0] for n in ours])
                except ValueError as e:
                    shapes = ", ".join(f"'{n}' {spec(*layout[n])}" for n in ours)
                    bad.append(f"{e}, for {shapes}")
                    break
                theirs = tuple(p.format(**binding) for p in rule.rule.theirs)
                dtype = layout[ours[0]][1]
                planned.append(_Planned(rule, binding, ours, theirs, steps, dtype))
                break
            else:
                unmapped.append(name)
        if unmapped or incomplete:
            raise ValueError(
                "The name map does not cover the model: "
                + listed(
                    [f"no rule for '{n}'" for n in unmapped]
                    + [f"joined rule {x} in the model" for x in incomplete]
                )
                + ".\nHint: add a rule for each of these names, or list names that "
                "exist only in eqxscan's model in `keep=`."
            )
        if bad:
            raise ValueError(
                "The name map's operations do not fit the model's arrays: "
                + listed(bad)
                + ".\nHint: check the Reshape/Split sizes against the model's "
                "configuration."
            )
        self._check_theirs(planned)
        return planned, kept

    def _check_theirs(self, planned: Sequence["_Planned"]) -> None:
        # Two arrays under one external name (of two rules, or two pieces of one
        # Split): export kept one, load read it twice.
        first: dict[str, tuple[str, int]] = {}
        clashes = [
            f"'{other[0]}' and '{p.ours[0]}' both to '{name}'"
            for p in planned
            for k, name in enumerate(p.theirs)
            if (other := first.setdefault(name, (p.ours[0], k))) != (p.ours[0], k)
        ]
        if clashes:
            raise ValueError(
                f"The name map maps two of the model's arrays to one name: "
                f"{listed(clashes)}.\nHint: give each array its own external name "
                "(a rule's pattern repeated by mistake?)."
            )
        # An ignored name is of their side only: never written, never read.
        ignored = [
            f"'{p.ours[0]}' to '{name}'"
            for p in planned
            for name in p.theirs
            if any(r.fullmatch(name) for r in self._ignore)
        ]
        if ignored:
            raise ValueError(
                f"The name map's rules map the model's arrays to names that its "
                f"ignore= lists: {listed(ignored)}.\nHint: to leave an array out "
                "of the file (and keep like's on load), list its name in keep=."
            )

    def _binding(self, name: str) -> dict[str, int]:
        # The placeholders' values in an external name: by the rule it matches,
        # or, matching none, the name's numeric parts (`h.3.mlp.w`: layer 3).
        for rule in self._rules:
            for regex in rule.theirs_regex:
                if m := regex.fullmatch(name):
                    return {k: int(v) for k, v in m.groupdict().items()}
        numbers = [int(part) for part in name.split(".") if part.isdecimal()]
        if len(numbers) == 1:
            return {"layer": numbers[0]}
        return {f"index {k}": n for k, n in enumerate(numbers)}

    def _depths(
        self, planned: Sequence["_Planned"], external: Mapping[str, object]
    ) -> tuple[int, int] | None:
        # `(the file's layers, the model's)` when they differ: the layer indices
        # of one-placeholder names are 0..N-1 on each side, each of the file's
        # layers with as many names.
        model = {_layer(p.binding) for p in planned if len(p.binding) == 1}
        bindings = (self._binding(n) for n in external)
        counts = collections.Counter(_layer(b) for b in bindings if len(b) == 1)
        found = set(counts)
        if (
            len(set(counts.values())) != 1  # none, or not whole layers: name each
            or not model
            or len(model) == len(found)
            or model != set(range(len(model)))
            or found != set(range(len(found)))
        ):
            return None
        return len(found), len(model)

    # Export.

    def plan_export(
        self, entries: Sequence[tuple[str, Lazy]]
    ) -> list[tuple[str, Lazy]]:
        # The external entries made from eqxscan's, read when asked for (a fused
        # array once per piece).
        reads = {name: lazy.read for name, lazy in entries}
        planned, _ = self._plan({name: (x.shape, x.dtype) for name, x in entries})
        out: list[tuple[str, Lazy]] = []
        for p in planned:
            for k, name in enumerate(p.theirs):
                read = _piece(p.rule, [reads[n] for n in p.ours], k)
                out.append((name, Lazy(p.steps[-1][k], p.dtype, read)))
        return out

    def export(self, model: PyTree) -> dict[str, np.ndarray]:
        """The external state dict of `model` (concrete arrays), in its order."""
        entries = self.plan_export(host_entries(model, "NameMap.export"))
        return {name: lazy.read() for name, lazy in entries}

    # Load.

    def mapping(
        self,
        like: PyTree,
        external: Mapping[str, object],
        *,
        source: str = "the external state dict",
        cast: np.dtype | None = None,
    ) -> dict[str, object]:
        # eqxscan's state dict for `like`, made lazily from `external` (values
        # with `shape` and `dtype`), after checking every name and shape at once;
        # `source`: a file's, when not the default, read with `dtype=cast`.
        leaves = {name: (leaf, index) for name, leaf, index in entries_of(like)}
        layout = {name: (leaf.shape, leaf.dtype) for name, (leaf, _) in leaves.items()}
        planned, kept = self._plan(layout)
        expected = {name: (p, k) for p in planned for k, name in enumerate(p.theirs)}
        missing, wrong, recast = [], [], []
        depths = self._depths(planned, external)
        for name, (p, k) in expected.items():
            if name not in external:
                if depths is None or _layer(p.binding) < depths[0]:
                    missing.append(
                        f"missing '{name}'{_where(p.binding)} for '{p.ours[0]}'"
                    )
                continue
            shape, dtype = shape_dtype(external[name])
            want = p.steps[-1][k]
            if shape != want or dtype != p.dtype:
                floats = all(jnp.issubdtype(d, jnp.floating) for d in (dtype, p.dtype))
                (recast if shape == want and floats else wrong).append(
                    f"'{name}'{_where(p.binding)} is {spec(shape, dtype)}, "
                    f"'{p.ours[0]}' needs {spec(want, p.dtype)}"
                )
        unused = [
            f"unused '{n}'{_where(self._binding(n))}"
            for n in external
            if n not in expected
            and not any(r.fullmatch(n) for r in self._ignore)
            and (depths is None or _layer(self._binding(n)) < depths[1])
        ]
        problems = wrong + recast + missing + unused
        if depths is not None:
            # One line for what would be a missing or unused name per array.
            n_file, n_model = depths
            depth = f"the file has {n_file} layers, the model {n_model}"
            if not problems:
                raise ValueError(
                    f"The names in {source} do not fit the model through the name "
                    f"map: {depth}.\nHint: build the model with the file's number "
                    "of layers (its configuration's depth)."
                )
            problems.insert(0, depth)
        if problems:
            counts = ", ".join(
                f"{len(x)} {what}"
                for x, what in (
                    (wrong, "mis-shaped"),
                    (recast, "of another dtype"),
                    (missing, "missing"),
                    (unused, "unused"),
                )
                if x
            )
            to = sorted({p.dtype.name for p in planned})
            arg = f"dtype=jnp.{to[0]}" if len(to) == 1 else "dtype="
            hint = (
                cast_hint(arg, cast, source != "the external state dict")
                if len(recast) == len(problems)
                else "a depth or size of the model's configuration differs from the "
                "file's, or the map needs a rule (or an `ignore=` pattern for names "
                "of their side only)"
            )
            raise ValueError(
                f"The names in {source} do not match the model through the name "
                f"map ({counts}): {listed(problems)}.\nHint: {hint}."
            )
        state: dict[str, object] = {}
        for p in planned:
            reads = _inverse(p, [external[n] for n in p.theirs])
            state |= {n: Lazy(layout[n][0], p.dtype, r) for n, r in zip(p.ours, reads)}
        for name in kept:
            leaf, index = leaves[name]
            leaf = leaf.leaf
            if not isinstance(leaf, (jax.Array, np.ndarray)):
                raise TypeError(
                    f"'{name}' is kept from like (NameMap keep=), but like holds an "
                    f"abstract {describe(leaf)} there.\nHint: pass a like with "
                    "concrete arrays for the names in keep=."
                )
            state[name] = np.asarray(leaf)[index]
        return state

    def load(self, like: T, external: Mapping[str, object]) -> T:
        """`like` with its arrays from `external`, a state dict of external names
        (NumPy or JAX arrays). Every unmapped, unused or mis-shaped name is
        reported at once, with its layer."""
        check_like("NameMap.load", like)
        return from_state_dict(like, self.mapping(like, external))


@dataclasses.dataclass
class _Planned:
    rule: _Compiled
    binding: dict[str, int]
    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    steps: list[list[Shape]]
    dtype: np.dtype


def _piece(
    rule: _Compiled, reads: list[Callable[[], np.ndarray]], k: int
) -> Callable[[], np.ndarray]:
    return lambda: rule.export([r() for r in reads])[k]


def _inverse(p: _Planned, values: list[object]) -> list[Callable[[], np.ndarray]]:
    # The eqxscan arrays of a joined rule come from the same pieces: read them
    # once, and let each go once it has been taken.
    cache: dict[int, np.ndarray] = {}

    def read(k: int) -> np.ndarray:
        if k not in cache:
            cache.update(
                enumerate(p.rule.load([np.asarray(v) for v in values], p.steps))
            )
        return cache.pop(k)

    return [functools.partial(read, k) for k in range(len(p.ours))]
