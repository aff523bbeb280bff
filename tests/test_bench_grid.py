"""`python -m eqxscan.bench --grid` on a tiny grid: every variant compiled, timed
and compared, the default found to be the same program as an explicit setting."""

import json

from eqxscan.bench import _cli, _grid


def test_tiny_grid_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(_grid, "MLP_POINTS", [(8, 6)])
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
    # Six layers, mostly elementwise residuals: recompute.
    assert mlp["choice"]["label"] == "remat/u1"
    # Three small steps: unrolled fully, which is the loop's program.
    assert gru["choice"]["label"] == "save-all/full"
    assert gru["temp_bytes"]["default"] == gru["temp_bytes"]["loop"]
    table = (tmp_path / "grid.md").read_text()
    assert "| MLP D=8 L=6 | remat/u1 |" in table
    assert "| GRU H=4 T=3 | save-all/full |" in table
    assert (tmp_path / "grid.png").stat().st_size > 0
    assert table in capsys.readouterr().out
