"""`python -m eqxscan.bench`: its correctness check, arguments and a tiny run."""

import json
import re

import jax
import jax.numpy as jnp
import pytest

from eqxscan.bench import _cli, _report, _transformer, make_problem
from eqxscan.bench._impls import Built, Impl, IMPLS
from eqxscan.bench._measure import (
    check_agreement,
    measure_compile,
    MismatchError,
    model_flops,
)


TINY = dict(dim=8, batch=2, seq=3)


def _perturbed(model):
    # Computes a slightly different function: w1 scaled by 1.001.
    built = IMPLS["jax-scan"].build(model)

    def loss(params, x, y):
        return built.loss({**params, "w1": params["w1"] * 1.001}, x, y)

    return Built(built.params, loss, built.to_canon)


def _raises(model):
    def loss(params, x, y):
        raise ValueError("this implementation is broken")

    return Built(IMPLS["jax-scan"].build(model).params, loss, lambda g: g)


BROKEN = Impl("broken", "w1 scaled by 1.001", _perturbed)


def test_every_implementation_matches_the_loop():
    impls = [impl for impl in IMPLS.values() if impl.available()]
    errors = check_agreement(impls, num_layers=3, **TINY)
    compared = {i.name for i in impls if i.name != "matmul-floor"}
    assert set(errors) == compared
    assert all(err <= 1e-5 for err in errors.values()), errors
    assert errors["eqxscan-loop"] == 0.0


def test_gradients_map_back_to_the_stacked_layout():
    # A gradient that is not the loop's must be caught even when the loss agrees:
    # swap two layers' w1 in the mapping back.
    def swapped(model):
        built = IMPLS["jax-scan"].build(model)

        def to_canon(g):
            canon = built.to_canon(g)
            return {**canon, "w1": canon["w1"][::-1]}

        return Built(built.params, built.loss, to_canon)

    with pytest.raises(MismatchError, match="gradient of w1"):
        check_agreement(
            [Impl("swapped", "layers swapped", swapped)], num_layers=2, **TINY
        )


def test_broken_implementation_is_detected():
    with pytest.raises(MismatchError, match=r"broken .*max relative error"):
        check_agreement([IMPLS["eqxscan"], BROKEN], num_layers=2, **TINY)
    with pytest.raises(MismatchError, match="failed to compute.*is broken"):
        check_agreement([Impl("raises", "raises", _raises)], num_layers=2, **TINY)


def test_broken_implementation_aborts_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(IMPLS, "broken", BROKEN)
    argv = ["--impls", "eqxscan,broken", "--layers", "2", "--dim", "8"]
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


def test_parse_defaults_and_quick():
    args = _cli.parse_args([])
    assert args.layers == [4, 16, 64, 256]
    assert (args.dim, args.batch, args.seq, args.repeats) == (256, 8, 64, 10)
    assert args.dtype == "float32"
    assert args.impls == [n for n, i in IMPLS.items() if i.available()]
    quick = _cli.parse_args(["--quick"])
    assert quick.layers == [4, 16] and quick.dim == 64
    assert set(quick.impls) <= set(_cli.QUICK_IMPLS)
    # Explicit arguments win over the preset; depths are sorted and deduplicated.
    mixed = _cli.parse_args(["--quick", "--dim", "32", "--layers", "8,2,8"])
    assert mixed.dim == 32 and mixed.layers == [2, 8] and mixed.seq == 16


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
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        _cli.parse_args(argv)
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
    assert _with_sizes([(277, "dots/u1"), (277, "dots/u1")]) is True
    assert _with_sizes([(277, "dots/u1"), (257, "remat/u1")]) is True
    assert _with_sizes([(277, "dots/u1"), (300, "dots/u1")]) is False
    assert _with_sizes([(417, "save-all/full"), (1677, "save-all/full")]) is False
    assert _with_sizes([(277, None), (300, None)]) is False


def test_only_the_default_records_what_auto_resolved_to():
    # The other eqxscan entries set `checkpoint` themselves; their rows stay plain.
    size = dict(num_layers=9, dtype="float32", **TINY)
    assert measure_compile("eqxscan-remat", **size)["auto"] is None
    resolved = measure_compile("eqxscan", **size)["auto"]
    assert re.fullmatch(r"(save-all|dots|remat)/u1", resolved)


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


def test_tiny_end_to_end_run(tmp_path, capsys):
    argv = ["--layers", "9,10", "--dim", "8", "--batch", "2", "--seq", "3"]
    argv += ["--impls", "eqxscan,eqxscan-loop", "--repeats", "3"]
    argv += ["--out", str(tmp_path)]
    assert _cli.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["errors"] == []
    assert results["agreement"]["eqxscan"] <= 1e-5
    assert {(r["impl"], r["layers"]) for r in results["compile"]} == {
        (n, L) for n in ("eqxscan", "eqxscan-loop") for L in (9, 10)
    }
    for row in results["compile"]:
        assert row["total_s"] >= row["compile_s"] > 0 and row["hlo_lines"] > 0
        assert row["temp_bytes"] >= 0 and row["argument_bytes"] > 0
    # The loop's lowered program grows with depth; the scan's does not (from L=9:
    # the default unrolls stacks of at most eight small layers).
    lines = {(r["impl"], r["layers"]): r["hlo_lines"] for r in results["compile"]}
    # What "auto" resolved to is recorded for the default, and shown in its row.
    auto = {(r["impl"], r["layers"]): r["auto"] for r in results["compile"]}
    assert auto["eqxscan", 9] == auto["eqxscan", 10]
    assert re.fullmatch(r"(save-all|dots|remat)/u1", auto["eqxscan", 9])
    assert auto["eqxscan-loop", 9] is None
    assert lines["eqxscan", 9] == lines["eqxscan", 10]
    assert lines["eqxscan-loop", 10] > lines["eqxscan-loop", 9]
    assert set(results["steps"]) == {"9", "10"}
    for per_impl in results["steps"].values():
        assert {len(t) for t in per_impl.values()} == {3}
    md = (tmp_path / "results.md").read_text()
    assert "### L = 10" in md and "| eqxscan-loop |" in md and "## Targets" in md
    assert f"| eqxscan ({auto['eqxscan', 10]}) |" in md
    assert md in capsys.readouterr().out
    for name in ("compile_time.png", "step_time.png", "temp_memory.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


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


# The Transformer model (`--model transformer`), compile repeats and MFU.


def test_transformer_implementations_match_the_loop():
    # eqxscan's own options are checked against the loop by the engine's tests;
    # here: eqxscan's default and every peer's way of writing the block.
    names = ("eqxscan", "eqxscan-loop", "eqx-recipe", "jax-scan")
    names += ("flax-linen", "flax-nnx")
    impls = [_transformer.IMPLS[n] for n in names if _transformer.IMPLS[n].available()]
    # D=64 gives two heads, so that the heads' layout is checked too.
    assert _transformer.num_heads(64) == 2
    errors = check_agreement(
        impls, model="transformer", num_layers=2, dim=64, batch=2, seq=3
    )
    assert set(errors) == {i.name for i in impls}
    assert all(err <= 1e-5 for err in errors.values()), errors
    assert errors["eqxscan-loop"] == 0.0


def test_transformer_mismatch_is_detected():
    def swapped_heads(model):
        # Same loss, but the gradient of the key projection handed back in the
        # wrong orientation: must be caught.
        built = _transformer.IMPLS["jax-scan"].build(model)
        to_canon = lambda g: {**g, "wk": jnp.swapaxes(g["wk"], 1, 2)}  # noqa: E731
        return Built(built.params, built.loss, to_canon)

    with pytest.raises(MismatchError, match="gradient of wk"):
        check_agreement(
            [Impl("swapped", "wk transposed", swapped_heads)],
            model="transformer",
            num_layers=1,
            dim=8,
            batch=1,
            seq=3,
        )


def test_parse_transformer_and_gpu_defaults(monkeypatch):
    args = _cli.parse_args(["--model", "transformer"])
    assert args.layers == [4, 16, 64]
    assert (args.dim, args.batch, args.seq, args.dtype) == (128, 8, 32, "float32")
    assert "eqxscan-offload" in args.impls and "matmul-floor" not in args.impls
    assert args.compile_repeats == 1
    quick = _cli.parse_args(["--model", "transformer", "--quick"])
    assert quick.dim == 32 and "matmul-floor" not in quick.impls
    assert _cli.parse_args(["--compile-repeats", "3"]).compile_repeats == 3
    monkeypatch.setattr(_cli, "_backend", lambda: "gpu")
    gpu = _cli.parse_args([])
    assert (gpu.dim, gpu.dtype, gpu.batch * gpu.seq) == (4096, "bfloat16", 8192)
    assert _cli.parse_args(["--dim", "512", "--dtype", "float32"]).dim == 512
    command = _cli.resolved_command(gpu)
    assert "--dim 4096" in command and "--dtype bfloat16" in command
    assert _cli.parse_args(command.split()[3:]) == gpu


def test_peak_table():
    from eqxscan.remat._devices import peak_of

    assert peak_of("NVIDIA H100 80GB HBM3").flops == 989e12
    assert peak_of("NVIDIA H100 PCIe").flops == 756e12
    assert peak_of("NVIDIA A100-SXM4-80GB").flops == 312e12
    assert peak_of("NVIDIA L4").flops == 121e12
    assert peak_of("cpu") is None


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
        "command": "python -m eqxscan.bench --model transformer",
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


def test_tiny_transformer_run_with_compile_repeats(tmp_path):
    argv = ["--model", "transformer", "--layers", "1", "--dim", "8", "--batch", "1"]
    argv += ["--seq", "3", "--impls", "eqxscan", "--repeats", "2"]
    argv += ["--compile-repeats", "2", "--out", str(tmp_path)]
    assert _cli.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["errors"] == [] and results["config"]["model"] == "transformer"
    for row in results["compile"]:
        assert len(row["total_samples"]) == 2
        assert row["total_s"] == pytest.approx(sum(row["total_samples"]) / 2)
    assert "--compile-repeats 2" in results["resolved_command"]
