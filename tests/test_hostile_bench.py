"""The bench runner, the cell store and the command-line plumbing fed hostile input: copied cell directories,
grid flags that leave methods out, task names that are not one path component, unwritable summaries, a full
disk, clashing stabilizer plug-ins, and the suites a wheel install must find."""

import json
import shutil
from pathlib import Path

from conftest import bench, quadratic_suite

from gacbench.bench.cell import cell_dir


def _copy_cell(out: Path, src: dict, dst: dict) -> None:
    shutil.copytree(cell_dir(out, src), cell_dir(out, dst))


# -- a copied cell stands only for the cell it was computed for -----------------------------------------------
def test_a_cell_copied_to_another_seed_or_staleness_is_refused_naming_the_key(tmp_path, capsys):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    base = {"task": "quadratic", "method": "stale", "staleness": 4, "seed": 0}
    _copy_cell(out, base, {**base, "seed": 1})
    capsys.readouterr()
    assert bench(suite, out, "--seeds", "0,1") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seed: 0 (stored) -> 1 (now)" in err
    shutil.rmtree(cell_dir(out, {**base, "seed": 1}))
    _copy_cell(out, base, {**base, "staleness": 8})
    assert bench(suite, out, "--staleness", "0,4,8") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "staleness: 4 (stored) -> 8 (now)" in err
    shutil.rmtree(cell_dir(out, {**base, "staleness": 8}))
    assert bench(suite, out) == 0  # the originals are still reused


def test_a_copied_cell_whose_config_json_alone_differs_is_refused(tmp_path, capsys):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    base = {"task": "quadratic", "method": "stale", "staleness": 4, "seed": 0}
    copy = {**base, "seed": 1}
    _copy_cell(out, base, copy)
    status_path = cell_dir(out, copy) / "status.json"
    status = json.loads(status_path.read_text())
    status["cell"]["seed"] = 1  # the status's copy edited to match; config.json still says seed 0
    status_path.write_text(json.dumps(status))
    capsys.readouterr()
    assert bench(suite, out, "--seeds", "0,1") == 2
    assert "seed: 0 (stored) -> 1 (now)" in capsys.readouterr().err


def test_a_cell_computed_with_another_warmup_is_refused(tmp_path, capsys):
    suite, out = quadratic_suite(tmp_path, methods=["sync", "stale"]), tmp_path / "out"
    assert bench(suite, out) == 0
    (tmp_path / "w").mkdir()
    capsys.readouterr()
    assert bench(quadratic_suite(tmp_path / "w", methods=["sync", "stale"], warmup=9), out) == 2
    assert "warmup: 5 (stored) -> 9 (now)" in capsys.readouterr().err
