"""Optional dependencies: Orbax is imported only by `checkpoint.CheckpointManager`,
which without it names the extra to install."""

import subprocess
import sys

import pytest

from eqxscan import checkpoint


def test_import_eqxscan_leaves_orbax_out():
    code = (
        "import sys, eqxscan, eqxscan.sharding; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'orbax'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_checkpoint_manager_without_orbax_names_the_extra(monkeypatch, tmp_path):
    # A `None` entry in sys.modules makes `import orbax...` raise ImportError.
    for name in [m for m in sys.modules if m.split(".")[0] == "orbax"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "orbax", None)
    with pytest.raises(ImportError, match=r"needs Orbax") as info:
        checkpoint.CheckpointManager(tmp_path)
    assert 'Hint: pip install "eqxscan[orbax]"' in str(info.value)
