"""A stabilizer plug-in that cannot be loaded is left out with one warning naming it; the built-ins, the other
plug-ins, `gacbench stabilizers` and the loss-side methods keep working."""

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
