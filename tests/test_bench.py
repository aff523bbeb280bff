"""`python -m benchmarks.bench` at its smallest size: the implementations agree
with the loop (and a wrong one is caught), the arguments are checked, and the
report judges its targets. One tiny run end to end, its workers measuring and its
report showing what they measured, is in `test_bench_device.py`."""

import importlib
import re

import jax
import jax.numpy as jnp
import pytest

from benchmarks.bench import _cli, _report, _transformer, make_problem
from benchmarks.bench._impls import Built, Impl, IMPLS
from benchmarks.bench._measure import check_agreement, MismatchError, model_flops

from .bench_impls import perturbed as _perturbed


TINY = dict(dim=8, batch=2, seq=3)


#: The peers; eqxscan's own options are checked against the loop by the engine's
#: tests (and its default by the tiny run below).
PEERS = ("eqx-recipe", "jax-scan", "flax-linen", "flax-nnx")


def _swapped(model):
    # The loss agrees, but two layers' gradients of w1 are handed back swapped.
    built = IMPLS["jax-scan"].build(model)

    def to_canon(g):
        canon = built.to_canon(g)
        return {**canon, "w1": canon["w1"][::-1]}

    return Built(built.params, built.loss, to_canon)


def _raises(model):
    def loss(params, x, y):
        raise ValueError("this implementation is broken")

    return Built(IMPLS["jax-scan"].build(model).params, loss, lambda g: g)


BROKEN = Impl("broken", "w1 scaled by 1.001", _perturbed)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_peers_match_the_loop(model):
    registered = IMPLS if model == "mlp" else _transformer.IMPLS
    impls = [registered[n] for n in PEERS if registered[n].available()]
    # The Transformer at D=64 has two heads, so that their layout is checked too.
    size = TINY if model == "mlp" else dict(dim=64, batch=1, seq=2)
    errors = check_agreement(impls, model=model, num_layers=2, **size)
    assert set(errors) == {i.name for i in impls}
    assert all(err <= 1e-5 for err in errors.values()), errors


def test_a_wrong_implementation_is_caught():
    with pytest.raises(MismatchError, match=r"broken .*max relative error"):
        check_agreement([BROKEN], num_layers=2, **TINY)
    with pytest.raises(MismatchError, match="gradient of w1"):
        check_agreement([Impl("swapped", "swapped", _swapped)], num_layers=2, **TINY)
    with pytest.raises(MismatchError, match="failed to compute.*is broken"):
        check_agreement([Impl("raises", "raises", _raises)], num_layers=2, **TINY)


def test_a_wrong_implementation_aborts_the_run(monkeypatch, tmp_path):
    # The check runs in a worker, which gets `broken` from tests/bench_impls.py.
    monkeypatch.setenv("BENCH_EXTRA_IMPLS", "tests.bench_impls")
    argv = ["--impls", "broken", "--layers", "2", "--dim", "8"]
    argv += ["--batch", "2", "--seq", "3", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="aborted: broken .*disagrees"):
        _cli.main(argv)
    assert not (tmp_path / "results.json").exists()


def test_model_flops_counts_the_matmuls():
    # The matmul floor is exactly the model's matmuls: XLA's own count is 6L matmuls
    # less the input gradient of the first one (not needed), plus a small loss.
    layers, dim, batch, seq = 3, 16, 2, 4
    model, x, y = make_problem("mlp", layers, dim, batch, seq, "float32")
    built = IMPLS["matmul-floor"].build(model)
    compiled = jax.jit(jax.value_and_grad(built.loss)).lower(built.params, x, y)
    xla = compiled.compile().cost_analysis()["flops"]
    ours = model_flops(layers, dim, batch * seq)
    one_matmul = ours / (6 * layers)
    assert ours - one_matmul <= xla <= ours - one_matmul + 16 * batch * seq * dim


def test_bfloat16_problem():
    # Every implementation keeps bfloat16 parameters (and so gradients) end to end.
    model, x, y = make_problem("mlp", 2, 8, 1, 2, "bfloat16")
    assert model.dtype == jnp.bfloat16 and x.dtype == jnp.bfloat16
    for impl in IMPLS.values():
        if impl.available():
            built = impl.build(model)
            step = jax.value_and_grad(built.loss)
            loss, grads = jax.eval_shape(step, built.params, x, y)
            assert loss.dtype == jnp.float32, impl.name
            dtypes = {g.dtype for g in jax.tree.leaves(grads)}
            assert dtypes == {jnp.dtype(jnp.bfloat16)}, (impl.name, dtypes)


def test_arguments(monkeypatch):
    # Explicit arguments win over a preset; depths are sorted and deduplicated.
    mixed = _cli.parse_args(["--quick", "--dim", "32", "--layers", "8,2,8"])
    assert mixed.dim == 32 and mixed.layers == [2, 8]
    assert set(mixed.impls) <= set(_cli.QUICK_IMPLS)
    transformer = _cli.parse_args(["--model", "transformer"])
    assert "matmul-floor" not in transformer.impls
    # An accelerator's presets (the backend as a worker reports it): bfloat16 and
    # sizes that fill a device; `--quick` and explicit arguments still win.
    tpu = _cli.parse_args([], backend="tpu")
    assert (tpu.dtype, tpu.dim, tpu.batch * tpu.seq) == ("bfloat16", 4096, 8192)
    tpu = _cli.parse_args(["--model", "transformer", "--dim", "512"], backend="tpu")
    assert (tpu.dtype, tpu.dim, tpu.seq) == ("bfloat16", 512, 1024)
    assert _cli.parse_args(["--quick"], backend="tpu").dim == _cli.QUICK["dim"]
    assert _cli.parse_args([], backend="gpu").dim == 4096
    assert _cli.parse_args([]).dtype == "float32"
    # The agreement check's size: the shallowest depth, capped.
    assert _cli.check_size(_cli.parse_args([], backend="tpu")) == dict(
        num_layers=4, dim=256, batch=2, seq=64, model="mlp"
    )
    # The resolved command reproduces the run, whatever the presets are.
    for backend in ("cpu", "gpu", "tpu"):
        for argv in (
            [],
            ["--model", "transformer", "--quick"],
            ["--model", "transformer"],
            ["--peak-flops", "1e15"],
        ):
            args = vars(_cli.parse_args(argv, backend))
            command = _cli.resolved_command(_cli.parse_args(argv, backend))
            again = vars(_cli.parse_args(command.split()[3:], backend))
            assert again | {"quick": args["quick"]} == args


def test_peak_table():
    from eqxscan.remat import peak_of

    assert peak_of("NVIDIA H100 80GB HBM3").flops == 989e12
    assert peak_of("NVIDIA H100 PCIe").flops == 756e12
    assert peak_of("NVIDIA A100-SXM4-80GB").flops == 312e12
    assert peak_of("cpu") is None
    # TPUs by their `device_kind`, as the bench's machine description gives it.
    assert peak_of("tpu:TPU v5 lite").flops == 197e12
    assert peak_of("tpu:TPU v5").flops == 459e12
    assert peak_of("tpu:TPU v4").flops == 275e12
    assert peak_of("tpu:TPU v6 lite").flops == 918e12


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--layers", "4,x"], "comma-separated positive integers"),
        (["--layers", "0,4"], "every depth must be a positive integer"),
        (["--dim", "-3"], "expected a positive integer, got -3"),
        (["--repeats", "ten"], "expected a positive integer, got 'ten'"),
        (["--dtype", "float16"], "invalid choice: 'float16'"),
        (["--impls", "eqxscan,haiku"], "unknown implementation.*haiku.*eqx-recipe"),
        (["--impls", ","], "names no implementation"),
        (["--peak-flops", "-1"], "expected a positive number, got '-1'"),
        (["--peak-flops", "nan"], "expected a positive number, got 'nan'"),
        (["--grid", "--impls", "eqxscan"], "--grid takes only --out and --repeats"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        # `main` reads --grid first, and checks before any worker starts.
        (_cli.main if "--grid" in argv else _cli.parse_args)(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_missing_optional_dependency(monkeypatch, capsys):
    needs = Impl("needs-x", "needs x", _perturbed, requires="no_such_module_xyz")
    monkeypatch.setitem(IMPLS, "needs-x", needs)
    args = _cli.parse_args([])
    assert "needs-x" not in args.impls and args.skipped == ["needs-x"]
    with pytest.raises(SystemExit):
        _cli.parse_args(["--impls", "needs-x"])
    assert "pip install -e '.[bench]'" in capsys.readouterr().err


# The report's targets, judged from synthetic numbers.


def _synthetic(step_eqxscan, nested_temps):
    steps = {
        str(L): {"eqxscan": [step_eqxscan], "eqxscan-loop": [1.0], "flax-nnx": [2.0]}
        for L in (16, 64)
    }
    compile_rows = [
        {"impl": name, "layers": L, "total_s": t, "hlo_lines": 100, "temp_bytes": m}
        for L, m in zip((16, 64), nested_temps)
        for name, t in (("eqxscan", 1.0), ("eqx-recipe", 1.0), ("eqxscan-nested", 1))
    ]
    return {"steps": steps, "compile": compile_rows}


SIZE_TARGET = "eqxscan lowered size independent of L (per resolved option)"


def _with_sizes(sizes_and_choices):
    results = _synthetic(0.9, (4, 8))
    rows = [r for r in results["compile"] if r["impl"] == "eqxscan"]
    for row, (lines, auto) in zip(rows, sizes_and_choices):
        row["hlo_lines"], row["auto"] = lines, auto
    return {t["target"]: t["met"] for t in _report.targets(results)}[SIZE_TARGET]


def test_program_size_target_is_per_resolved_option():
    # The same resolution must give the same program at every depth; different
    # resolutions (policy when shallow, full remat when deep) may differ.
    assert _with_sizes([(277, "matmul/u1"), (277, "matmul/u1")]) is True
    # ... but then nothing was compared: not met, not measured.
    assert _with_sizes([(277, "matmul/u1"), (257, "remat/u1")]) is None
    assert _with_sizes([(277, "matmul/u1"), (300, "matmul/u1")]) is False
    assert _with_sizes([(277, None), (300, None)]) is False


def test_targets_are_judged_from_the_numbers():
    good = {t["target"]: t["met"] for t in _report.targets(_synthetic(0.9, (4, 8)))}
    assert good["eqxscan step <= 1.0x eqxscan-loop (L >= 16)"] is True
    assert good["eqxscan step <= 0.6x flax-nnx (L >= 16)"] is True
    assert good["eqxscan step <= 0.6x flax-linen (L >= 16)"] is None
    assert good["eqxscan compile time <= 1.1x eqx-recipe"] is True
    assert good[SIZE_TARGET] is True
    assert good["'nested' temp(L=64)/temp(L=16) <= 2.50 (grows like sqrt(L))"]
    bad = {t["target"]: t["met"] for t in _report.targets(_synthetic(1.5, (4, 16)))}
    assert bad["eqxscan step <= 1.0x eqxscan-loop (L >= 16)"] is False
    assert bad["eqxscan step <= 0.6x flax-nnx (L >= 16)"] is False
    assert bad["'nested' temp(L=64)/temp(L=16) <= 2.50 (grows like sqrt(L))"] is False


def _synthetic_transformer(eqx_compile, loop_compile, peak=None):
    rows = [
        {"impl": n, "layers": 64, "total_s": t, "trace_s": 0.0, "lower_s": 0.0}
        | {"compile_s": t, "hlo_lines": 10, "temp_bytes": m}
        for n, t, m in (
            ("eqxscan", eqx_compile, 10),
            ("eqxscan-loop", loop_compile, 20),
            ("eqx-recipe", 1.0, 20),
        )
    ]
    steps = {"64": {"eqxscan": [0.5], "eqxscan-loop": [1.0], "eqx-recipe": [2.0]}}
    return {
        "config": {"model": "transformer", "dim": 128, "batch": 8, "seq": 32}
        | {"dtype": "float32", "repeats": 1, "compile_repeats": 3},
        "machine": {"summary": "test"},
        "impls": {"eqxscan": "", "eqxscan-loop": "", "eqx-recipe": ""},
        "flops_per_step": {"64": 2e12},
        "peak_flops": peak,
        "agreement": {},
        "compile": rows,
        "steps": steps,
        "command": "python -m benchmarks.bench --model transformer",
    }


def test_transformer_targets_and_mfu():
    met = {
        t["target"]: t["met"]
        for t in _report.targets(_synthetic_transformer(1.0, 13.0))
    }
    assert met == {
        "L=64: eqxscan compiles >= 12x faster than eqxscan-loop": True,
        "L=64: eqxscan step <= 1.0x eqxscan-loop": True,
        "L=64: eqxscan temp memory <= 1.0x eqxscan-loop": True,
        "L=64: eqxscan compile <= 1.1x eqx-recipe": True,
    }
    missed = _report.targets(_synthetic_transformer(1.2, 13.0))
    assert [t["met"] for t in missed] == [False, True, True, False]
    # MFU: 2e12 FLOPs in 0.5 s against a 1e13 FLOP/s peak is 40%.
    md = _report.markdown(_synthetic_transformer(1.0, 13.0, peak=1e13))
    assert "| MFU |" in md and "| 40.0% |" in md
    assert "MFU" not in _report.markdown(_synthetic_transformer(1.0, 13.0))
    assert "medians of 3 fresh compiles" in md


@pytest.mark.parametrize(
    "script, argv",
    [
        ("decode", ["--repeats", "0"]),
        ("quantized", ["--layers", "0"]),
        ("adapters", ["--rank", "0"]),
    ],
)
def test_single_benchmarks_refuse_sizes_below_one(script, argv, monkeypatch, capsys):
    # A usage error, not a traceback from deep in the step.
    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr("sys.argv", [script, *argv])
    with pytest.raises(SystemExit) as info:
        module.main()
    assert info.value.code == 2
    assert "must be positive, got" in capsys.readouterr().err
