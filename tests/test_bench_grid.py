"""`python -m eqxscan.bench --grid` on a tiny grid: every variant compiled, timed
and compared, the default found to be the same program as an explicit setting."""

import json
import os

import numpy as np
import pytest

from eqxscan.bench import _cli, _grid


def test_tiny_grid_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(_grid, "MLP_POINTS", [(8, 10)])
    monkeypatch.setattr(_grid, "RNN_POINTS", [("gru", 4, 3)])
    monkeypatch.setattr(_grid, "ROUND_BUDGET_S", 0.0)
    assert _cli.main(["--grid", "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "grid.json").read_text())
    mlp, gru = results["points"]
    names = {"default", "loop"} | {_grid._label(c, u) for c, u in _grid.EXPLICIT}
    full = {_grid._label(c, True) for c in (False, True, _grid.AUTO_POLICY)}
    for point, expected in ((mlp, names), (gru, names | full)):
        assert set(point["temp_bytes"]) == set(point["times"]) == expected
        assert all(len(t) == 2 for t in point["times"].values())
        # The default resolves to one of the explicit settings: the same program,
        # hence the same temp memory.
        twin = point["twin"]
        assert twin == point["choice"]["label"]
        assert point["temp_bytes"]["default"] == point["temp_bytes"][twin]
    # Ten layers, mostly elementwise residuals: recompute.
    assert mlp["choice"]["label"] == "remat/u1"
    # Three small steps: unrolled fully, which is the loop's program.
    assert gru["choice"]["label"] == "save-all/full"
    assert gru["temp_bytes"]["default"] == gru["temp_bytes"]["loop"]
    # ... so it is judged at the loop's speed; its own timings show the noise.
    assert gru["loop_program"] and not mlp["loop_program"]
    s = gru["summary"]
    assert s["default_vs_loop"] == 1.0
    assert s["default_vs_loop_measured"] == pytest.approx(
        np.median(np.asarray(gru["times"]["default"]) / gru["times"]["loop"])
    )
    assert (
        mlp["summary"]["default_vs_loop"] == mlp["summary"]["default_vs_loop_measured"]
    )
    table = (tmp_path / "grid.md").read_text()
    assert "| MLP D=8 L=10 | remat/u1 |" in table
    assert "| GRU H=4 T=3 | save-all/full | 1.00× |" in table
    assert f"loop ({s['default_vs_loop_measured']:.2f}×), save-all/full (" in table
    assert (tmp_path / "grid.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert table in out
    # The cores XLA may use change which settings are fastest: recorded (as
    # `taskset` leaves them), and printed first.
    cores = len(os.sched_getaffinity(0))
    assert results["machine"]["cores_usable"] == cores
    assert out.startswith(results["machine"]["summary"])
    assert f", {cores} cores)" in results["machine"]["summary"]
    assert len(results["machine"]["load_average_end"]) == 3


def test_long_point_extrapolates_the_loops_memory(monkeypatch, tmp_path):
    # Past `MAX_LOOP_LENGTH` the loop is not compiled at the point's length: its
    # temp memory is the line through two shorter loops, checked here against the
    # loops compiled at those lengths and at the full length.
    monkeypatch.setattr(_grid, "MAX_LOOP_LENGTH", 16)
    monkeypatch.setattr(_grid, "ROUND_BUDGET_S", 0.0)
    results = _grid.run_grid(tmp_path, 2, points=[("gru", (4, 32))])
    (point,) = results["points"]
    assert "loop" not in point["times"]

    def loop_temp(steps):
        model, loss, inputs, with_options = _grid._problem("gru", (4, steps))
        return _grid._compile_step(loss, with_options(model, mode="loop"), inputs)[0]

    extrapolated = point["loop_temp_extrapolated"]
    assert extrapolated["lengths"] == [8, 16]
    assert extrapolated["bytes"] == [loop_temp(8), loop_temp(16)]
    actual = loop_temp(32)
    assert abs(extrapolated["estimate"] - actual) <= 0.02 * actual
    # The memory rule and the table use the loop's (extrapolated) memory, not the
    # plain scan's, which stands in for the loop's step time only.
    summary = point["summary"]
    assert summary["reference"] == _grid.REF
    default = point["temp_bytes"]["default"]
    assert summary["default_mem_vs_loop"] == default / extrapolated["estimate"]
    assert "| GRU H=4 T=32* |" in (tmp_path / "grid.md").read_text()
    assert f"| {extrapolated['estimate'] / 2**20:.2f} | 2 |" in _grid._row(point)
