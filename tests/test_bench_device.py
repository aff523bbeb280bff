"""`python -m benchmarks.bench` on an accelerator: one process at a time owns the
device, so the parent never opens it (every measurement, the agreement check and
the machine's description run in workers); what does not fit in the device's
memory is reported and the rest still measured; the agreement check runs at the
highest matmul precision with a tolerance per dtype."""

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from benchmarks.bench import _measure
from benchmarks.bench._impls import MismatchError, TOLERANCES
from benchmarks.bench._measure import check_agreement

from .bench_impls import gradient_scaled, TOO_BIG_BATCH


ROOT = Path(__file__).resolve().parents[1]
#: The parent's backend made unusable, as a TPU held by another process would be:
#: any `jax.devices()`, `jax.default_backend()` or array in it raises. The workers
#: are fresh processes and use `$JAX_PLATFORMS` (cpu here).
PARENT = """
import sys
import jax

jax.config.update("jax_platforms", "held_by_another_process")
from benchmarks.bench._cli import main

code = main(sys.argv[1:])
try:
    jax.devices()
except RuntimeError as e:
    print("parent backend:", str(e).splitlines()[0])
sys.exit(code)
"""


def test_tiny_run_in_workers_reports_what_it_measured_and_what_does_not_fit(
    tmp_path,
):
    # One depth, the default against the loop, each compiled and timed in fresh
    # processes; the default compiled twice (its time is the median of both).
    # `too-big` runs out of memory at the measured batch (not at the agreement
    # check's); it comes first, so that the others are compiled and timed after
    # it. The parent's backend is unusable throughout.
    argv = ["--layers", "9", "--dim", "8", "--batch", str(TOO_BIG_BATCH)]
    argv += ["--seq", "3", "--impls", "too-big,eqxscan,eqxscan-loop"]
    argv += ["--repeats", "3", "--compile-repeats", "2", "--loop-compile-repeats", "1"]
    argv += ["--out", str(tmp_path)]
    env = {**os.environ, "BENCH_EXTRA_IMPLS": "tests.bench_impls"}
    run = subprocess.run(
        [sys.executable, "-c", PARENT, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # The block held: the parent could not have opened a backend.
    assert "parent backend: Unable to initialize backend" in run.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    # The workers described the machine and checked agreement.
    assert results["machine"]["backend"] == "cpu"
    assert results["machine"]["device"].startswith("cpu:")
    agreement = results["agreement"]
    assert agreement["precision"] == "highest"
    assert agreement["size"] == dict(num_layers=9, dim=8, batch=2, seq=3, model="mlp")
    assert set(agreement["errors"]) == {"float32"}
    assert agreement["errors"]["float32"]["eqxscan"] <= 1e-5
    assert set(agreement["errors"]["float32"]) == {"too-big", "eqxscan", "eqxscan-loop"}
    # `too-big` did not fit, at its compile and at the timed steps; no error.
    assert results["errors"] == []
    stages = {(r["impl"], r["layers"], r["stage"]) for r in results["does_not_fit"]}
    assert stages == {("too-big", 9, "compile"), ("too-big", 9, "steps")}
    assert all("RESOURCE_EXHAUSTED" in r["error"] for r in results["does_not_fit"])
    # The others were measured.
    rows = {r["impl"]: r for r in results["compile"]}
    assert set(rows) == {"eqxscan", "eqxscan-loop"}
    assert len(rows["eqxscan"]["total_samples"]) == 2
    assert len(rows["eqxscan-loop"]["total_samples"]) == 1
    for row in rows.values():
        assert row["total_s"] == pytest.approx(statistics.median(row["total_samples"]))
        assert row["total_s"] >= row["compile_s"] > 0 and row["hlo_lines"] > 0
        assert row["temp_bytes"] >= 0 and row["argument_bytes"] > 0
    # Nine layers are scanned (the default unrolls at most eight small ones): the
    # loop's program is the longer, and what "auto" resolved to is recorded.
    assert rows["eqxscan-loop"]["hlo_lines"] > rows["eqxscan"]["hlo_lines"]
    auto = rows["eqxscan"]["auto"]
    assert re.fullmatch(r"(save-all|matmul|remat)/u1", auto)
    assert rows["eqxscan-loop"]["auto"] is None
    steps = results["steps"]["9"]
    assert set(steps) == {"eqxscan", "eqxscan-loop"}
    assert {len(t) for t in steps.values()} == {3}
    # The table shows those numbers: median step time and its ratio to the loop,
    # program size and temp memory; and `too-big`'s cells say it does not fit.
    md = (tmp_path / "results.md").read_text()
    assert md in run.stdout
    row = next(line for line in md.splitlines() if line.startswith("| eqxscan ("))
    cells = [c.strip() for c in row.strip("|").split("|")]
    ms = {n: statistics.median(t) * 1e3 for n, t in steps.items()}
    assert cells[0] == f"eqxscan ({auto})"
    assert cells[1] == f"{ms['eqxscan']:.1f}"
    assert cells[2] == f"{ms['eqxscan'] / ms['eqxscan-loop']:.2f}"
    assert cells[-3] == str(rows["eqxscan"]["hlo_lines"])
    assert cells[-2] == f"{rows['eqxscan']['temp_bytes'] / 2**20:.1f}"
    row = next(line for line in md.splitlines() if line.startswith("| too-big |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "does not fit" and cells[5] == "does not fit"
    assert "## Does not fit" in md and "too-big at L=9 (steps): " in md
    assert "too-big at L=9 does not fit (compile): " in run.stderr
    assert "--compile-repeats 2 --loop-compile-repeats 1" in results["resolved_command"]
    for name in ("compile_time.png", "step_time.png", "temp_memory.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_agreement_tolerance_per_dtype(dtype):
    # A gradient off by half the dtype's tolerance passes; one off by 1.5 times
    # it is caught.
    tolerance = TOLERANCES[dtype]
    size = dict(num_layers=2, dim=8, batch=2, seq=3, dtype=dtype)
    errors = check_agreement([gradient_scaled(1 + tolerance / 2)], **size)
    assert tolerance / 4 < max(errors.values()) <= tolerance
    with pytest.raises(MismatchError, match=f"gradient of w1.* > {tolerance:g}"):
        check_agreement([gradient_scaled(1 + 1.5 * tolerance)], **size)
    assert TOLERANCES["float32"] < TOLERANCES["bfloat16"]


def test_agreement_runs_at_the_highest_matmul_precision(monkeypatch):
    # The probe's gradient is off by 10% unless traced at "highest".
    probe = gradient_scaled(1.0, matmul_precision="highest")
    size = dict(num_layers=2, dim=8, batch=2, seq=3)
    assert check_agreement([probe], **size)[probe.name] <= TOLERANCES["float32"]
    # The probe can fail: at another precision it is caught.
    monkeypatch.setattr(_measure, "CHECK_PRECISION", "float32")
    with pytest.raises(MismatchError, match="gradient of w1"):
        check_agreement([probe], **size)


# The single-process scripts: a size that does not fit is reported, the next
# measured.


def _resource_exhausted(*args):
    # XLA's own refusal of a 16 TiB buffer (nothing is allocated), as a device
    # refuses what is bigger than its memory.
    jnp.zeros((2**42,), jnp.float32)


def test_decode_reports_what_does_not_fit(monkeypatch, capsys):
    from benchmarks import decode

    real = decode.measure

    def measure(num_layers, *args):
        if num_layers == 3:
            _resource_exhausted()
        return real(num_layers, *args)

    monkeypatch.setattr(decode, "measure", measure)
    argv = ["decode", "--layers", "3", "2", "--length", "8", "--batch", "1"]
    argv += ["--dim", "8", "--heads", "2", "--repeats", "1", "--variants", "in place"]
    monkeypatch.setattr("sys.argv", argv)
    decode.main()
    out = capsys.readouterr().out.splitlines()
    rows = [r for r in out if r[:4] in ("| 3 ", "| 2 ")]
    assert rows[0].startswith("| 3 | 8 | 1 | does not fit: JaxRuntimeError: RESOURCE")
    assert [r.split("|")[4].strip() for r in rows[1:]] == ["in place", "loop"]


def test_quantized_reports_what_does_not_fit(monkeypatch, capsys):
    from benchmarks import quantized

    real = quantized.measure

    def measure(batch, *args):
        if batch == 2:
            _resource_exhausted()
        return real(batch, *args)

    monkeypatch.setattr(quantized, "measure", measure)
    monkeypatch.setattr(quantized, "FORMATS", ("float32", "bfloat16", "int8"))
    argv = ["quantized", "--batch", "2", "1", "--layers", "2", "--dim", "128"]
    monkeypatch.setattr("sys.argv", [*argv, "--repeats", "1"])
    quantized.main()
    out = capsys.readouterr().out
    timing = out.split("\n\nTargets")[0].splitlines()[2:]
    # Targets for the size that was measured only; int4 and fp8 not measured.
    assert "Targets at B=2" not in out
    targets = out.split("\n\nTargets at B=1, L=2, D=128\n")[1].split("\n\n")[0]
    assert "int4 <= 0.4x bfloat16" in targets
    assert targets.count("not measured  not measured") == 4  # HBM twice, int4, fp8
    assert timing[0].split()[:4] == ["2", "2", "128", "does"]
    assert "does not fit: JaxRuntimeError: RESOURCE_EXHAUSTED" in timing[0]
    steps = len(quantized.STEPS)  # scan, unrolled and the default options
    formats = [r.split()[3] for r in timing[1:]]
    assert formats == ["float32"] * steps + ["bfloat16"] * steps + ["int8"] * steps


def test_adapters_report_what_does_not_fit(monkeypatch, capsys):
    from benchmarks import adapters

    real = adapters.measure

    def measure(dim, layers, rank, k, batch):
        if k == 2:
            _resource_exhausted()
        return real(dim, layers, rank, k, batch)

    def train_steps(*args):
        _resource_exhausted()

    monkeypatch.setattr(adapters, "measure", measure)
    monkeypatch.setattr(adapters, "train_steps", train_steps)
    monkeypatch.setattr("sys.argv", ["adapters", "--tiny"])
    adapters.main()
    out = capsys.readouterr().out
    rows = out.split("\n\n")[0].splitlines()[2:]
    assert rows[0].split()[0] == "1"
    assert rows[1].startswith("measure(16, 2, 2, 2, 4) does not fit: JaxRuntimeError")
    assert "train_steps(16, 2, 2, 4, 2) does not fit: JaxRuntimeError" in out
    assert "\ndecode step, one token per row, B=4" in out


def test_presets_and_peak_come_from_the_worker_that_describes_the_device(
    monkeypatch, tmp_path
):
    # The parent's side alone, its workers replaced: a worker reports a TPU v5e,
    # and the run takes the TPU preset, checks agreement at the small size in
    # float32 and bfloat16, and reports MFU against the chip's peak.
    from benchmarks.bench import _cli, _worker

    tasks = []

    def run_worker(spec, on_progress=lambda: None):
        tasks.append(spec)
        if spec["task"] == "describe":
            return {"backend": "tpu", "device": "tpu:TPU v5 lite", "summary": "v5e"}
        if spec["task"] == "agree":
            errors = {n: 0.0 for n in spec["impls"]}
            return {"errors": {d: errors for d in spec["dtypes"]}}
        if spec["task"] == "depth":  # all of a depth's in one worker
            rows, too_big = [], {}
            for name in spec["impls"]:
                if spec["num_layers"] == 16 and name == "eqx-recipe":
                    too_big[name] = "RESOURCE_EXHAUSTED: Ran out of memory"
                    continue
                row = dict(trace_s=0.1, lower_s=0.1, compile_s=0.1, total_s=0.3)
                row |= dict(hlo_lines=100, temp_bytes=2**20)
                rows.append({"impl": name, "layers": spec["num_layers"], **row})
            times = {n: [1.0] for n in spec["impls"] if n not in too_big}
            return dict(
                rows=rows, does_not_fit=too_big, times=times, steps_do_not_fit={}
            )
        raise AssertionError(f"no {spec['task']} worker on an accelerator")

    monkeypatch.setattr(_worker, "run_worker", run_worker)
    argv = ["--impls", "eqxscan,eqx-recipe", "--repeats", "1", "--out", str(tmp_path)]
    assert _cli.main(argv) == 0
    depths = len(_cli.TPU["layers"])
    assert [t["task"] for t in tasks] == ["describe", "agree"] + depths * ["depth"]
    assert tasks[1]["size"] == dict(num_layers=4, dim=256, batch=2, seq=64, model="mlp")
    assert tasks[1]["dtypes"] == ["float32", "bfloat16"]
    results = json.loads((tmp_path / "results.json").read_text())
    config = results["config"]
    assert (config["dim"], config["batch"] * config["seq"]) == (4096, 8192)
    assert (config["dtype"], config["layers"]) == ("bfloat16", _cli.TPU["layers"])
    assert {t["dtype"] for t in tasks if t["task"] == "depth"} == {"bfloat16"}
    assert results["peak_flops"] == 197e12
    assert results["does_not_fit"][0]["impl"] == "eqx-recipe"
    md = (tmp_path / "results.md").read_text()
    # 3 * 16 layers * 2 matmuls * 2 * 8192 * 4096 * 16384 FLOPs in one second.
    mfu = 100 * 3 * 16 * 2 * (2 * 8192 * 4096 * 16384) / 197e12
    assert "| MFU |" in md and f"| {mfu:.1f}% |" in md
    assert "- bfloat16 (tolerance 0.1): eqxscan 0.0e+00" in md


def test_one_worker_compiles_and_times_a_depth_as_separate_processes_would(
    monkeypatch,
):
    # On an accelerator a depth's compiles and steps share a worker: each is still
    # compiled afresh (the same program and memory as alone), each repeat count is
    # kept, one that does not fit is named and the others measured and timed on
    # the program compiled, one at a time; the process's peak RSS, shared, is
    # reported for none.
    monkeypatch.setenv("BENCH_EXTRA_IMPLS", "tests.bench_impls")
    size = dict(num_layers=9, dim=8, batch=TOO_BIG_BATCH, seq=3, dtype="float32")
    done = []
    found = _measure.measure_depth(
        ["too-big", "eqxscan", "eqxscan-loop"],
        compile_repeats=2,
        loop_compile_repeats=1,
        repeats=3,
        on_progress=lambda: done.append(1),
        **size,
    )
    assert len(done) == 3  # one tick an implementation
    assert list(found["does_not_fit"]) == ["too-big"]
    assert "RESOURCE_EXHAUSTED" in found["does_not_fit"]["too-big"]
    assert found["steps_do_not_fit"] == {}
    rows = {r["impl"]: r for r in found["rows"]}
    assert list(rows) == ["eqxscan", "eqxscan-loop"]
    assert len(rows["eqxscan"]["total_samples"]) == 2
    assert len(rows["eqxscan-loop"]["total_samples"]) == 1
    assert all(r["peak_rss_bytes"] is None for r in rows.values())
    assert sorted(found["times"]) == ["eqxscan", "eqxscan-loop"]
    assert all(len(t) == 3 and min(t) > 0 for t in found["times"].values())
    alone = _measure.measure_compile("eqxscan", **size)
    for what in ("hlo_lines", "temp_bytes", "argument_bytes", "auto"):
        assert rows["eqxscan"][what] == alone[what]
    assert rows["eqxscan-loop"]["hlo_lines"] > rows["eqxscan"]["hlo_lines"]


def test_train_step_script_reports_mfu_from_the_step_time(capsys):
    # `benchmarks/train_step.py`: one process, each implementation's median step
    # and the MFU that step gives against the peak it was told.
    from benchmarks import train_step
    from benchmarks.bench._measure import model_flops

    peak = 1e9
    train_step.main(
        ["--tiny", "--impls", "eqxscan,eqxscan-loop", "--peak-flops", "1e9"]
    )
    lines = capsys.readouterr().out.splitlines()
    rows = {ln.split()[0]: ln.split() for ln in lines[2:]}
    assert set(rows) == {"eqxscan", "eqxscan-loop"}
    for cells in rows.values():
        ms, mfu = float(cells[1]), float(cells[2].rstrip("%"))
        assert ms > 0

        # The printed time is rounded to 0.05 ms, the MFU to 0.05%.
        def mfu_at(ms):
            return 100 * model_flops(2, 32, 16) / (ms / 1e3) / peak

        assert mfu_at(ms + 0.05) - 0.05 <= mfu <= mfu_at(max(ms - 0.05, 1e-3)) + 0.05
