"""What one run of a compiled HLO module moves and multiplies: the result bytes
of each kind of collective and the FLOPs of its dots, read from the module's
text, every computation counted as often as it runs (XLA's own cost analysis
counts a loop body once)."""

import dataclasses
import math
import re


_COLLECTIVES = "all-gather all-reduce reduce-scatter all-to-all collective-permute"
_DTYPE_BYTES = {
    **dict.fromkeys(("pred", "s4", "u4", "s8", "u8", "f8e4m3fn", "f8e5m2"), 1),
    **dict.fromkeys(("s16", "u16", "f16", "bf16"), 2),
    **dict.fromkeys(("s32", "u32", "f32"), 4),
    **dict.fromkeys(("s64", "u64", "f64", "c64"), 8),
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \((.*)\) -> .* \{$")
_PARAM = re.compile(r",\s*(?=[\w.\-]+: )")
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%?([\w.\-]+)")
# A conditional's branches (`lax.cond`, `lax.switch`: a layer LayerDrop may
# skip), each counted as run once: an upper bound, as if every branch ran.
_BRANCHES = re.compile(
    r"\b(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=%?([\w.\-]+))"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OPERAND = re.compile(r"\s*%?([\w.\-]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


@dataclasses.dataclass
class _Computation:
    lines: list[str]  # its instructions
    params: dict[str, str]  # each parameter's name and shape text


def _ints(dims: str) -> list[int]:
    return [int(d) for d in dims.split(",") if d]


def _shape_bytes(text: str) -> int:
    arrays = _ARRAY.findall(text)
    return sum(_DTYPE_BYTES.get(t, 0) * math.prod(_ints(dims)) for t, dims in arrays)


def _dims(text: str) -> list[int]:
    m = _ARRAY.search(text)
    return [] if m is None else _ints(m.group(2))


def _computations(text: str) -> tuple[dict[str, _Computation], str | None]:
    """Every computation of the module by name, and the entry's name."""
    comps: dict[str, _Computation] = {}
    entry = None
    current: _Computation | None = None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            pairs = (p.split(":", 1) for p in _PARAM.split(header.group(2)) if ":" in p)
            params = {name.strip(): shape for name, shape in pairs}
            current = comps[header.group(1)] = _Computation([], params)
            if line.startswith("ENTRY"):
                entry = header.group(1)
        elif line.startswith("}"):
            current = None
        elif current is not None:
            current.lines.append(line)
    return comps, entry


def _calls(comp: _Computation, comps: dict[str, _Computation]) -> list[tuple[str, int]]:
    """`(callee, runs per run of comp)` for every call in `comp`, once per
    calling instruction: a while loop runs its body and condition its trip count
    times, a conditional each branch once. A reduction's `to_apply` (an add) is
    no work of its own."""
    out = []
    for line in comp.lines:
        trip = _TRIP.search(line)
        times = int(trip.group(1)) if trip and " while(" in line else 1
        for kind, callee in _CALLED.findall(line):
            if kind != "to_apply" and callee in comps:
                out.append((callee, times))
        for listed, one in _BRANCHES.findall(line):
            names = listed.split(",") if listed else [one]
            out += [(c, 1) for n in names if (c := n.strip().lstrip("%")) in comps]
    return out


def _runs(comps: dict[str, _Computation], entry: str) -> dict[str, int]:
    """How many times each computation reached from `entry` runs per run of it:
    the sum over the places that call it."""
    calls = {name: _calls(comp, comps) for name, comp in comps.items()}
    finished: list[str] = []  # each computation after every one it calls

    def visit(name: str) -> None:  # as deep as the calls nest: a few levels
        for callee, _ in calls[name]:
            if callee not in finished:
                visit(callee)
        finished.append(name)

    visit(entry)
    order = finished[::-1]  # callers first
    runs = dict.fromkeys(order, 0)
    runs[entry] = 1
    for name in order:
        for callee, times in calls[name]:
            runs[callee] += runs[name] * times
    return runs


def _dot_flops(line: str, result: str, operands: str, shapes: dict[str, str]) -> float:
    lhs = _OPERAND.match(operands)
    contract = _CONTRACTING.search(line)
    if lhs is None or contract is None:
        return 0.0
    lhs_dims = _dims(shapes.get(lhs.group(1), ""))
    k = math.prod(lhs_dims[i] for i in _ints(contract.group(1)) if i < len(lhs_dims))
    return 2.0 * math.prod(_dims(result)) * k


def _costs(comp: _Computation) -> tuple[dict[str, int], float]:
    """Collective bytes by kind and dot FLOPs of one run of `comp` alone."""
    shapes = dict(comp.params)  # a dot's operand may be a parameter
    collective: dict[str, int] = {}
    flops = 0.0
    for line in comp.lines:
        m = _INSTR.match(line)
        if not m:
            continue
        var, result, op, operands = m.groups()
        shapes[var] = result
        base = op.removesuffix("-start").removesuffix("-done")
        if base in _COLLECTIVES.split() and not op.endswith("-start"):
            # An async pair counts at its `-done`, whose result is the
            # collective's alone: the `-start`'s tuple holds the operands too
            # (an all-gather's, 1/N of its result) and context scalars.
            collective[base] = collective.get(base, 0) + _shape_bytes(result)
        elif op == "dot":
            flops += _dot_flops(line, result, operands, shapes)
    return collective, flops


def hlo_costs(text: str) -> tuple[dict[str, int], float]:
    """Collective result bytes by kind and matmul FLOPs of one run of the compiled
    HLO module `text`, each computation counted once per run: a loop body once
    per iteration, one called from two places twice."""
    comps, entry = _computations(text)
    if entry is None:
        return {}, 0.0
    collective: dict[str, int] = {}
    flops = 0.0
    for name, n in _runs(comps, entry).items():
        comp_collective, comp_flops = _costs(comps[name])
        for kind, size in comp_collective.items():
            collective[kind] = collective.get(kind, 0) + n * size
        flops += n * comp_flops
    return collective, flops
