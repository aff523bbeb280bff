"""`python -m eqxscan.bench --grid` on a tiny grid: every variant compiled, timed
and compared, the default found to be the same program as an explicit setting."""

import json
import os

import numpy as np
import pytest

from eqxscan.bench import _cli, _grid
from eqxscan.bench._measure import setting_label


def test_tiny_grid_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(_grid, "MLP_POINTS", [(8, 10)])
    monkeypatch.setattr(_grid, "RNN_POINTS", [("gru", 4, 3)])
    monkeypatch.setattr(_grid, "ROUND_BUDGET_S", 0.0)
    assert _cli.main(["--grid", "--repeats", "2", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "grid.json").read_text())
    mlp, gru = results["points"]
    names = {"default", "loop"} | {setting_label(c, u) for c, u in _grid.EXPLICIT}
    full = {setting_label(c, True) for c in (False, True, _grid.AUTO_POLICY)}
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
    # Ratios come from the confirming rounds (the default, the loop and the best
    # chosen on the first rounds, timed again), the first rounds' are kept.
    again = gru["confirm"]["times"]
    assert s["default_vs_loop_measured"] == pytest.approx(
        np.median(np.asarray(again["default"]) / again["loop"])
    )
    assert s["selection"]["default_vs_loop_measured"] == pytest.approx(
        np.median(np.asarray(gru["times"]["default"]) / gru["times"]["loop"])
    )
    for point in (mlp, gru):
        best = point["summary"]["best"]
        assert point["confirm"]["best"] == best
        assert set(point["confirm"]["times"]) == {"default", "loop", best}
        assert all(len(t) == 2 for t in point["confirm"]["times"].values())
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
    # loops compiled at those lengths and at the full length. Two explicit
    # settings suffice here (the plain scan stands in for the loop's step time).
    monkeypatch.setattr(_grid, "MAX_LOOP_LENGTH", 16)
    monkeypatch.setattr(_grid, "ROUND_BUDGET_S", 0.0)
    monkeypatch.setattr(_grid, "EXPLICIT", ((False, 1), (True, 1)))
    results = _grid.run_grid(tmp_path, 2, points=[("gru", (4, 24))])
    (point,) = results["points"]
    assert "loop" not in point["times"]
    assert set(point["times"]) == {"default", "save-all/u1", "remat/u1"}

    def loop_temp(steps):
        model, loss, inputs, with_options = _grid._problem("gru", (4, steps))
        return _grid._compile_step(loss, with_options(model, mode="loop"), inputs)[0]

    extrapolated = point["loop_temp_extrapolated"]
    assert extrapolated["lengths"] == [8, 16]
    assert extrapolated["bytes"] == [loop_temp(8), loop_temp(16)]
    actual = loop_temp(24)
    assert abs(extrapolated["estimate"] - actual) <= 0.02 * actual
    # The memory rule and the table use the loop's (extrapolated) memory, not the
    # plain scan's, which stands in for the loop's step time only.
    summary = point["summary"]
    assert summary["reference"] == _grid.REF
    default = point["temp_bytes"]["default"]
    assert summary["default_mem_vs_loop"] == default / extrapolated["estimate"]
    assert "| GRU H=4 T=24* |" in (tmp_path / "grid.md").read_text()
    assert f"| {extrapolated['estimate'] / 2**20:.2f} | 2 + 2 |" in _grid._row(point)


def _point(times, confirm, temp, twin=None):
    return {
        "times": times,
        "confirm": {"best": None, "rounds": 3, "times": confirm},
        "temp_bytes": temp,
        "choice": {"saved_bytes": 10 * 2**20},
        "twin": twin,
        "loop_program": False,
    }


def test_summary_confirms_the_best_in_fresh_rounds():
    # "b" wins the first rounds by luck; timed again, it is no faster than the
    # default. The reported ratio is the confirming rounds', not the lucky one.
    times = {
        "loop": [1.0, 1.0, 1.0],
        "default": [1.0, 1.0, 1.0],
        "a": [0.95, 0.95, 0.95],
        "b": [0.9, 0.9, 0.9],
        "c": [0.5, 0.5, 0.5],  # fastest, but over the memory rule
    }
    confirm = {"loop": [1.0, 1.1, 0.9], "default": [1.0, 1.1, 0.9], "b": [1.0] * 3}
    temp = {"loop": 100, "default": 50, "a": 100, "b": 90, "c": 101}
    s = _grid.summarise(_point(times, confirm, temp))
    assert s["best"] == "b"
    assert s["selection"]["default_vs_best"] == pytest.approx(1 / 0.9)
    assert s["default_vs_best"] == pytest.approx(1.0)
    assert s["best_vs_loop"] == pytest.approx(np.median([1.0, 1 / 1.1, 1 / 0.9]))
    assert s["loop_ms"] == pytest.approx(1e3)
    # Small residuals allow 1.25x the loop's temp memory: then "c" is allowed.
    small = _point(times, confirm | {"c": [0.6] * 3}, temp)
    small["choice"]["saved_bytes"] = 2**20
    s = _grid.summarise(small)
    assert s["best"] == "c"
    assert s["default_vs_best"] == pytest.approx(np.median([1 / 0.6, 1.1 / 0.6, 1.5]))
    # Where the best lowers to the default's own program, the default is the best.
    s = _grid.summarise(_point(times, confirm, temp, twin="b"))
    assert s["default_vs_best"] == 1.0
