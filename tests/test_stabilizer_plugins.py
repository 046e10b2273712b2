"""A stabilizer plug-in that cannot be loaded is left out with one warning naming it; the built-ins, the other
plug-ins, `gacbench stabilizers` and the loss-side methods keep working."""

import re
import subprocess
import sys
import warnings
from importlib.metadata import EntryPoint

import pytest

from gacbench.methods import method_callbacks
from gacbench.stabilizers import registry
from gacbench.stabilizers.registry import ENTRY_POINT_GROUP, available

BUILTINS = {"gac", "m2po", "bapo", "tis", "decoupled-ppo", "dual-clip", "gspo", "cispo", "tis-engine", "mis",
            "icepop", "vcpo", "m2po-threshold", "lr-scaled", "opsm", "geo-seq-mask", "vespo", "a3po"}


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Four fake entry points: a module that raises on import, a missing class, a class without a kind, and a
    working plug-in."""
    (tmp_path / "raising_plugin.py").write_text("raise RuntimeError('this plug-in needs a GPU driver')\n")
    (tmp_path / "good_plugin.py").write_text(
        "from gacbench.stabilizers.ppo import GSPO\n\nclass Good(GSPO):\n    \"\"\"A working plug-in.\"\"\"\n\n\n"
        "class Kindless:\n    \"\"\"No kind declared.\"\"\"\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [EntryPoint("raises", "raising_plugin:Stab", ENTRY_POINT_GROUP),
           EntryPoint("no-class", "good_plugin:Missing", ENTRY_POINT_GROUP),
           EntryPoint("no-kind", "good_plugin:Kindless", ENTRY_POINT_GROUP),
           EntryPoint("good", "good_plugin:Good", ENTRY_POINT_GROUP)]
    monkeypatch.setattr(registry, "entry_points", lambda group: [ep for ep in eps if ep.group == group])
    monkeypatch.setattr(registry, "_BROKEN", {})


def test_a_plugin_that_fails_to_load_is_left_out_with_one_warning_naming_it(plugins):
    with pytest.warns(RuntimeWarning) as caught:
        found = available()
    assert BUILTINS | {"good"} == set(found) and found["good"]["kind"] == "loss"
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3  # one per broken plug-in
    raises = next(m for m in messages if "'raises'" in m)
    assert "'raising_plugin'" in raises and "RuntimeError: this plug-in needs a GPU driver" in raises
    missing = next(m for m in messages if "'no-class'" in m)
    assert "'good_plugin'" in missing and "AttributeError" in missing and "Missing" in missing
    kindless = next(m for m in messages if "'no-kind'" in m)
    assert "its class needs kind = 'gradient' or 'loss', got None" in kindless and "left out" in kindless
    assert set(registry.broken()) == {"raises", "no-class", "no-kind"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same broken plug-ins are not warned about again
        assert set(available()) == set(found)


def test_loss_side_methods_work_beside_a_broken_plugin(plugins):
    with pytest.warns(RuntimeWarning, match="raises"):
        callbacks = method_callbacks("gac+m2po")
    assert [type(cb).__name__ for cb in callbacks] == ["GAC", "M2PO"]
    assert type(method_callbacks("good")[0]).__name__ == "Good"
    with pytest.raises(ValueError, match="unknown method 'raises'"):
        method_callbacks("raises")


def test_the_stabilizers_command_lists_the_rest_and_names_the_broken_plugin(tmp_path):
    site = tmp_path / "site"
    (site / "brokenplugin").mkdir(parents=True)
    (site / "brokenplugin" / "__init__.py").write_text("import a_module_that_is_not_installed\n")
    dist = site / "brokenplugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: brokenplugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nbroken = brokenplugin:Stab\n")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "gacbench.cli", "stabilizers"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    listed = {line.split()[0] for line in run.stdout.splitlines()}
    assert BUILTINS <= listed and "broken" not in listed  # a plug-in installed in this environment may add more
    assert "Traceback" not in run.stderr
    warned = [line for line in run.stderr.splitlines() if "RuntimeWarning" in line]
    assert len(warned) == 1
    assert all(s in warned[0] for s in ("'broken'", "'brokenplugin'", "ModuleNotFoundError",
                                        "a_module_that_is_not_installed"))


def _fake_dist(site, package: str, entry: str) -> None:
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(
        "from gacbench.stabilizers.ppo import GSPO\n\nclass Stab(GSPO):\n    \"\"\"A plug-in.\"\"\"\n")
    dist = site / f"{package}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry} = {package}:Stab\n")


@pytest.mark.parametrize("clash", ["two-plugins", "a-builtin"])
def test_two_stabilizers_with_one_name_are_refused_in_one_line_naming_both_packages(tmp_path, clash):
    site = tmp_path / "site"
    name = "same-name" if clash == "two-plugins" else "gspo"
    _fake_dist(site, "firstplugin", name)
    if clash == "two-plugins":
        _fake_dist(site, "secondplugin", name)
    run = subprocess.run([sys.executable, "-m", "gacbench.cli", "stabilizers"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    (line,) = run.stderr.splitlines()
    assert line.startswith("gacbench stabilizers: error: ") and f"stabilizer {name!r} is declared twice" in line
    packages = ("'firstplugin'", "'secondplugin'") if clash == "two-plugins" else ("gacbench (built in)",
                                                                                   "'firstplugin'")
    assert all(p in line for p in packages)


def test_a_plugin_with_a_methods_name_is_refused_naming_the_method(tmp_path):
    """A method spec reads the methods' names first: a plug-in named gac-skip would never run (built-in GAC would
    run, and be tabled, under it), so the name is refused in one line."""
    site = tmp_path / "site"
    _fake_dist(site, "shadowplugin", "gac-skip")
    run = subprocess.run([sys.executable, "-m", "gacbench.cli", "stabilizers"], capture_output=True, text=True,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    (line,) = run.stderr.splitlines()
    assert "stabilizer 'gac-skip' of package 'shadowplugin' (shadowplugin:Stab) has the name of a gacbench method" \
        in line and "GAC skipping steps" in line and "rename the entry point" in line


def test_a_plugin_whose_name_is_not_a_method_name_is_left_out_with_a_warning(plugins, monkeypatch):
    bad = EntryPoint("geo.mask", "good_plugin:Good", ENTRY_POINT_GROUP)
    upper = EntryPoint("GeoMask", "good_plugin:Good", ENTRY_POINT_GROUP)  # what a method spec reads as a name
    monkeypatch.setattr(registry, "entry_points", lambda group: [bad, upper] if group == ENTRY_POINT_GROUP else [])
    with pytest.warns(RuntimeWarning, match="'geo.mask'.*its entry-point name must match \\[A-Za-z0-9_-\\]\\+"):
        found = available()
    assert "geo.mask" not in found and set(found) == BUILTINS | {"GeoMask"}
    assert type(method_callbacks("GeoMask")[0]).__name__ == "Good"


def test_the_registry_holds_every_builtin_whatever_else_is_installed():
    found = available()
    assert BUILTINS <= set(found)  # a subset: an installed third-party plug-in adds names
    assert all(found[n]["source"] == "gacbench" for n in BUILTINS)


def test_the_installed_entry_points_are_read_once_per_search_path(tmp_path, monkeypatch):
    """A grid parses its methods hundreds of times; each call still gets dicts of its own."""
    reads = []

    def counting(group):
        reads.append(group)
        return []

    monkeypatch.setattr(registry, "entry_points", counting)
    first = available()
    first["gac"]["kind"] = "changed by a caller"
    assert available()["gac"]["kind"] == "gradient" and set(available()) == BUILTINS
    assert reads == [ENTRY_POINT_GROUP]
    monkeypatch.syspath_prepend(str(tmp_path))  # where a newly installed package would be found
    available()
    assert reads == [ENTRY_POINT_GROUP] * 2


_DAMP = '''import lightning.pytorch as pl

FACTOR = {factor}


class Damp(pl.Callback):
    """Scales the gradient by FACTOR."""

    kind = "gradient"

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        for p in pl_module.parameters():
            if p.grad is not None:
                p.grad.mul_(FACTOR)
'''


def test_a_plugins_code_is_part_of_its_cells_version_and_an_edit_in_place_is_another(tmp_path, monkeypatch, capsys):
    """A bench cell whose method uses a plug-in records the plug-in's distribution, version and code hash. After an
    edit of the plug-in in place (its version unchanged) the stored cells of that method are from another
    environment: a note, and --rerun-other-versions recomputes them and no other; a seed run with the edited code
    beside one run with the first is a group that mixes versions, named in the summary."""
    import json
    import re

    from conftest import bench, quadratic_suite, squash

    from gacbench.bench.cell import cell_dir
    from gacbench.bench.runner import expand_cells, load_suite

    site = tmp_path / "site"
    (site / "dampplugin").mkdir(parents=True)
    code = site / "dampplugin" / "__init__.py"
    code.write_text(_DAMP.format(factor=0.5))
    dist = site / "dampplugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dampplugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\ndamp = dampplugin:Damp\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_READ", {})

    def edit(factor: float) -> None:  # a new process would import the edited file
        code.write_text(_DAMP.format(factor=factor))
        monkeypatch.delitem(sys.modules, "dampplugin", raising=False)
        registry._READ.clear()

    out = tmp_path / "out"
    suite = quadratic_suite(tmp_path, methods=["sync", "stale", "damp"], seeds=[0])
    cells = {(c["method"], c["seed"]): c for c in expand_cells(load_suite(str(suite)))}
    assert bench(suite, out) == 0
    damp = cell_dir(out, cells[("damp", 0)])
    first = json.loads((damp / "config.json").read_text())["provenance"]["plugins"]
    assert set(first) == {"damp"} and first["damp"]["distribution"] == "dampplugin"
    assert first["damp"]["version"] == "0.1" and re.fullmatch("[0-9a-f]{64}", first["damp"]["sha256"])
    assert "plugins" not in json.loads((cell_dir(out, cells[("sync", 0)]) / "config.json").read_text())["provenance"]
    final = json.loads((damp / "status.json").read_text())["final"]

    edit(0.25)
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("cells/**/status.json")}
    capsys.readouterr()
    assert bench(suite, out) == 0
    said = squash(capsys.readouterr().out)
    assert "1 stored done cell(s) of this grid come from another environment" in said
    assert f"plugin damp {first['damp']['sha256'][:12]}" in said and "ran 0 cells" in said
    assert mtimes == {p: p.stat().st_mtime_ns for p in out.glob("cells/**/status.json")}

    seeds01 = quadratic_suite(tmp_path, "seeds01.yaml", methods=["sync", "stale", "damp"], seeds=[0, 1])
    assert bench(seeds01, out) == 0  # seed 1 with the edited plug-in, seed 0 kept from the first
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["versions"]) == 1
    assert {(p["sha256"] == first["damp"]["sha256"], p["cells"]) for p in summary["plugins"]} == {(True, 1),
                                                                                                  (False, 1)}
    assert [(g["method"], g["staleness"]) for g in summary["mixed_version_groups"]] == [("damp", 4)]
    assert "This grid mixes the code of a stabilizer plug-in" in (out / "summary.md").read_text()

    capsys.readouterr()
    assert bench(seeds01, out, "--rerun-other-versions") == 0
    assert "ran 1 cells" in squash(capsys.readouterr().out)  # seed 0's damp cell alone
    again = json.loads((damp / "config.json").read_text())["provenance"]["plugins"]["damp"]
    assert again["version"] == "0.1" and again["sha256"] != first["damp"]["sha256"]
    assert json.loads((damp / "status.json").read_text())["final"] != final  # computed by the edited code
    summary = json.loads((out / "summary.json").read_text())
    assert "mixed_version_groups" not in summary and len(summary["plugins"]) == 1


def test_a_plugins_code_hash_covers_its_other_modules(tmp_path, monkeypatch):
    """A plug-in whose class lives in a namespace package (no __init__.py) and reads a helper module beside it and a
    module its distribution installs outside the package: an edit of either changes the recorded hash."""
    from gacbench.methods import plugin_provenance

    site = tmp_path / "site"
    (site / "nsplug").mkdir(parents=True)
    (site / "nsplug" / "damp.py").write_text(
        "import lightning.pytorch as pl\n\nfrom nsplug.helper import FACTOR\n\n\nclass Damp(pl.Callback):\n"
        "    \"\"\"Scales the gradient.\"\"\"\n\n    kind = \"gradient\"\n")
    (site / "nsplug" / "helper.py").write_text("FACTOR = 0.5\n")
    (site / "coreplug.py").write_text("SCALE = 1.0\n")
    dist = site / "nsplug-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nsplug\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nns-damp = nsplug.damp:Damp\n")
    (dist / "RECORD").write_text("nsplug/damp.py,,\nnsplug/helper.py,,\ncoreplug.py,,\nnsplug-0.1.dist-info/RECORD,,\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_READ", {})
    hashes = [plugin_provenance("ns-damp")["ns-damp"]["sha256"]]
    (site / "nsplug" / "helper.py").write_text("FACTOR = 0.25\n")
    hashes.append(plugin_provenance("ns-damp")["ns-damp"]["sha256"])
    (site / "coreplug.py").write_text("SCALE = 2.0\n")
    hashes.append(plugin_provenance("ns-damp")["ns-damp"]["sha256"])
    assert len(set(hashes)) == 3 and all(re.fullmatch("[0-9a-f]{64}", h) for h in hashes)
    assert plugin_provenance("ns-damp")["ns-damp"]["version"] == "0.1"


def test_a_plugins_code_hash_is_over_every_portion_of_its_namespace_package_in_name_order(tmp_path, monkeypatch):
    """A namespace package split over two directories, with a distribution that records only its metadata: the hash
    is that of the sorted (name, file) pairs of every .py file of both portions, and of nothing else (not the
    distribution's top_level.txt)."""
    from importlib import metadata

    from gacbench.provenance import named_files_sha256
    from gacbench.stabilizers.registry import plugin_record

    a, b = tmp_path / "A", tmp_path / "B"
    (a / "nsplug2").mkdir(parents=True)
    (b / "nsplug2").mkdir(parents=True)
    (a / "nsplug2" / "damp.py").write_text("from nsplug2.helper import F\n\n\nclass Damp:\n    kind = 'gradient'\n")
    (a / "nsplug2" / "zz.py").write_text("Z = 1\n")
    (b / "nsplug2" / "helper.py").write_text("F = 0.5\n")
    dist = a / "nsplug2-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: nsplug2\nVersion: 0.1\n")
    (dist / "top_level.txt").write_text("nsplug2\n")
    (dist / "RECORD").write_text("nsplug2-0.1.dist-info/METADATA,,\nnsplug2-0.1.dist-info/top_level.txt,,\n")
    monkeypatch.syspath_prepend(str(b))
    monkeypatch.syspath_prepend(str(a))
    from nsplug2.damp import Damp

    info = {"cls": Damp, "dist": metadata.distribution("nsplug2"), "distribution": "nsplug2", "version": "0.1"}
    pairs = sorted([("nsplug2/damp.py", a / "nsplug2" / "damp.py"), ("nsplug2/zz.py", a / "nsplug2" / "zz.py"),
                    ("nsplug2/helper.py", b / "nsplug2" / "helper.py")])
    assert plugin_record(info)["sha256"] == named_files_sha256(pairs)
