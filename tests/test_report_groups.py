"""Groups defined by everything but the seed, and the code versions of a summary, on hand-written stored cells."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gacbench.bench.cell import cell_dir
from gacbench.bench.groups import cell_settings, settings_labels
from gacbench.bench.report import build_report
from gacbench.jsonio import write_json
from gacbench.provenance import environment_key

PARAMS = {"optimizer": "sgd", "lr": 0.1, "sigma2": 10.0, "kappa": 10.0}


def _prov(source: str, commit: str = "a" * 40, dirty: bool = False) -> dict:
    return {"code": {"commit": commit, "dirty": dirty}, "source_sha256": source * 64,
            "packages": {"torch": "2.13.0", "lightning": "2.5.0", "vllm": None, "transformers": "4.0"},
            "threads": 1, "device": "cpu"}


def _store(root, method, s, seed, final, *, params=PARAMS, steps=4, task="quadratic", prov=None, **extra):
    """A done quadratic cell written by hand: config.json, status.json and a metrics.csv of ``steps`` rows."""
    cell = {"task": task, "objective": "quadratic", "params": params, "steps": steps, "warmup": 0,
            "method": method, "staleness": s, "seed": seed, **extra}
    if prov is not None:
        cell["provenance"] = prov
    d = cell_dir(root, cell)
    d.mkdir(parents=True)
    write_json(d / "config.json", cell)
    rows = "".join(f"{t},{final + 1.0 / (t + 1)},{0.5 - 0.1 * t}\n" for t in range(steps))
    (d / "metrics.csv").write_text("step,eval/gap,align/cos\n" + rows)
    write_json(d / "status.json", {"status": "done", "initial": 10.0, "final": final, "diverged": False,
                                   "metric": "gap", "higher_is_better": False, "steps_run": steps, "cell": cell})
    return cell


def _two_settings(root):
    """quadratic at lr 0.1 and 4 steps (seeds 0, 1) and at lr 0.05 and 6 steps (seeds 2, 3), in one directory."""
    other = {**PARAMS, "lr": 0.05}
    for seed, (sync, stale, gac) in zip((0, 1), ((1.0, 5.0, 2.0), (1.2, 5.4, 2.2))):
        _store(root, "sync", 0, seed, sync)
        _store(root, "stale", 2, seed, stale)
        _store(root, "gac", 2, seed, gac)
    for seed, (sync, stale, gac) in zip((2, 3), ((3.0, 4.0, 3.0), (3.0, 4.2, 3.8))):
        _store(root, "sync", 0, seed, sync, params=other, steps=6)
        _store(root, "stale", 2, seed, stale, params=other, steps=6)
        _store(root, "gac", 2, seed, gac, params=other, steps=6)


def test_cells_of_one_task_with_two_settings_are_two_groups(tmp_path):
    _two_settings(tmp_path)
    rep = build_report(tmp_path)
    a, b = "quadratic (lr=0.1, steps=4)", "quadratic (lr=0.05, steps=6)"
    groups = {(g["task"], g["method"]): g for g in rep["summary"]["groups"]}
    assert sorted({t for t, _ in groups}) == sorted([a, b])
    # means over each setting's own two seeds, by hand
    assert groups[(a, "sync")]["final_mean"] == pytest.approx(1.1)
    assert groups[(a, "stale")]["final_mean"] == pytest.approx(5.2)
    assert groups[(b, "stale")]["final_mean"] == pytest.approx(4.1)
    assert groups[(b, "gac")]["final_mean"] == pytest.approx(3.4)
    assert all(g["n"] == 2 for g in groups.values())
    assert groups[(b, "gac")]["settings"] == {"params.lr": 0.05, "steps": 6}
    # each setting's share against its own sync and stale: (5.2 - 2.1) / (5.2 - 1.1) and (4.1 - 3.4) / (4.1 - 3.0)
    shares = {r["task"]: r["share"] for r in rep["summary"]["recovered"]}
    assert shares == pytest.approx({a: 3.1 / 4.1, b: 0.7 / 1.1})
    # the stored cells keep their task, with the group they belong to
    cell = next(c for c in rep["summary"]["cells"] if c["seed"] == 3 and c["method"] == "gac")
    assert cell["task"] == "quadratic" and cell["group"] == b and cell["settings"] == {"params.lr": 0.05, "steps": 6}
    md = (tmp_path / "summary.md").read_text()
    assert f"## {a}: final gap" in md and f"## {b}: final gap" in md
    names = {p.name for p in rep["figures"]}
    assert {"fig_curves_quadratic_lr=0.1_steps=4.png", "fig_curves_quadratic_lr=0.05_steps=6.png"} <= names


def test_a_task_with_one_setting_keeps_its_plain_name(tmp_path):
    for seed in (0, 1):
        _store(tmp_path, "sync", 0, seed, 1.0 + seed)
        _store(tmp_path, "stale", 2, seed, 5.0 + seed)
    rep = build_report(tmp_path)
    assert {g["task"] for g in rep["summary"]["groups"]} == {"quadratic"}
    assert all("settings" not in g for g in rep["summary"]["groups"])
    assert all("group" not in c for c in rep["summary"]["cells"])
    assert rep["summary"]["groups"][0]["n"] == 2


def test_settings_are_everything_but_the_seed_and_name_only_the_keys_that_differ():
    base = {"task": "t", "objective": "grpo", "params": {"lr": 1e-3, "engine": {"name": "hf"}}, "steps": 4,
            "warmup": 1, "method": "gac", "staleness": 2, "seed": 0, "provenance": {"x": 1},
            "calibration": {"c_low": 0.1}, "ablation": False}
    assert cell_settings(base) == {"objective": "grpo", "params.lr": 1e-3, "params.engine.name": "hf", "steps": 4,
                                   "warmup": 1}
    assert cell_settings({"task": "t", "objective": None, "params": {}}) is None  # known only from its path
    other = {**base, "seed": 1, "params": {"lr": 1e-3, "engine": {"name": "vllm"}}, "assumptions": 10,
             "provenance": {"y": 2}, "calibration": {"c_low": 0.2}}
    same_as_base = {**base, "seed": 5, "method": "sync", "staleness": 0}
    labels = settings_labels([base, other, same_as_base])
    assert labels[("t", "gac", 2, 0)] == ("t (assumptions=unset, engine.name=hf)",
                                          {"assumptions": None, "params.engine.name": "hf"})
    assert labels[("t", "gac", 2, 1)][0] == "t (assumptions=10, engine.name=vllm)"
    assert labels[("t", "sync", 0, 5)] == labels[("t", "gac", 2, 0)]
    assert settings_labels([base, same_as_base]) == {}  # seed, method, staleness, provenance: not settings


def test_versions_list_each_environment_and_the_groups_that_mix_them(tmp_path):
    new, old = _prov("1"), _prov("2", commit="b" * 40, dirty=True)
    for seed in (0, 1):
        _store(tmp_path, "sync", 0, seed, 1.0, prov=new)
        _store(tmp_path, "gac", 2, seed, 2.0, prov=new)
    _store(tmp_path, "stale", 2, 0, 5.0, prov=new)
    _store(tmp_path, "stale", 2, 1, 5.0, prov=old)  # one seed of stale in another version
    _store(tmp_path, "stale", 4, 0, 6.0)  # stored without provenance
    summary = build_report(tmp_path)["summary"]
    assert summary["versions"] == [
        {"key": environment_key(new), "description": "commit aaaaaaaaaa", "cells": 5},
        {"key": environment_key(old), "description": "commit bbbbbbbbbb (dirty)", "cells": 1},
        {"key": "unrecorded", "description": "unrecorded (no provenance stored with the run)", "cells": 1}]
    assert summary["mixed_version_groups"] == [
        {"task": "quadratic", "method": "stale", "staleness": 2,
         "versions": sorted([environment_key(new), environment_key(old)])}]
    envs = {(c["method"], c["staleness"], c["seed"]): c["environment"] for c in summary["cells"]}
    assert envs[("stale", 2, 1)] == environment_key(old) and envs[("stale", 4, 0)] == "unrecorded"
    md = (tmp_path / "summary.md").read_text()
    assert "**This grid mixes 3 code versions**" in md.split("\n## ")[0]  # said before the first table
    assert "1 group(s) average seeds run in different versions: quadratic / stale / s=2." in md
    assert f"- commit bbbbbbbbbb (dirty): `{environment_key(old)}`, 1 cell" in md
    assert json.loads((tmp_path / "summary.json").read_text())["versions"][0]["cells"] == 5


def test_cells_of_one_code_version_from_different_initial_weights_are_two_versions(tmp_path):
    # the same library and stack, but one seed of stale started from another warm-started checkpoint
    same, other = _prov("4"), {**_prov("4"), "initial_weights": "e" * 64}
    base = {**same, "initial_weights": "d" * 64}
    for seed in (0, 1):
        _store(tmp_path, "sync", 0, seed, 1.0, prov=base)
    _store(tmp_path, "stale", 2, 0, 5.0, prov=base)
    _store(tmp_path, "stale", 2, 1, 5.0, prov=other)
    summary = build_report(tmp_path)["summary"]
    assert [v["cells"] for v in summary["versions"]] == [3, 1]
    assert summary["versions"][0]["key"] == environment_key(same) + " weights dddddddddddd"
    assert summary["mixed_version_groups"][0]["method"] == "stale"
    assert set(summary["mixed_version_groups"][0]["versions"]) == {v["key"] for v in summary["versions"]}
    # what a process compares with its own before it loads a model: the code environment alone
    assert environment_key(base, weights=False) == environment_key(other, weights=False) == environment_key(same)
    assert ("threads and device, the instruction set where recorded, and the initial weights of a task whose cells "
            "started from more than one;") in (tmp_path / "summary.md").read_text()


def test_tasks_that_start_from_different_checkpoints_are_one_code_version(tmp_path):
    """llm-size's model sizes start from different checkpoints: one commit and machine is one code version, and a
    grid of it is published; a task whose own cells started from two is still two (above)."""
    for task, weights in (("tiny", "d" * 64), ("small", "e" * 64)):
        for seed in (0, 1):
            _store(tmp_path, "sync", 0, seed, 1.0, task=task, prov={**_prov("7"), **INTEL, "initial_weights": weights})
            _store(tmp_path, "stale", 2, seed, 5.0, task=task, prov={**_prov("7"), **AMD, "initial_weights": weights})
    summary = build_report(tmp_path)["summary"]
    assert [v["key"] for v in summary["versions"]] == sorted(
        environment_key({**_prov("7"), **cpu}) for cpu in (AMD, INTEL))  # the CPU kinds, not the start points
    assert "mixed_version_groups" not in summary or not summary["mixed_version_groups"]
    assert summary["machine_blocks"]["code_versions"] == [environment_key(_prov("7"))]
    assert {c["environment"] for c in summary["cells"]} == {v["key"] for v in summary["versions"]}  # one key
    # each task's start point (θ₀) is listed with its cells, in summary.json and under Code versions
    assert summary["start_points"] == [{"task": "small", "initial_weights": "e" * 64, "cells": 4},
                                       {"task": "tiny", "initial_weights": "d" * 64, "cells": 4}]
    md = (tmp_path / "summary.md").read_text()
    assert f"- small: `{'e' * 64}`, 4 cells" in md and f"- tiny: `{'d' * 64}`, 4 cells" in md


def test_a_single_version_grid_says_nothing_about_mixing(tmp_path):
    prov = _prov("3")
    for seed in (0, 1):
        _store(tmp_path, "sync", 0, seed, 1.0, prov=prov)
        _store(tmp_path, "stale", 2, seed, 5.0, prov=prov)
    summary = build_report(tmp_path)["summary"]
    assert summary["versions"] == [{"key": environment_key(prov), "description": "commit aaaaaaaaaa", "cells": 4}]
    assert "start_points" not in summary and "plugins" not in summary  # none recorded
    assert "mixed_version_groups" not in summary
    md = (tmp_path / "summary.md").read_text()
    assert "## Code versions" in md and "mixes" not in md
    assert "threads and device; the commit" in md  # no instruction set or weights recorded: not named


INTEL = {"isa": "AVX512", "cpu_vendor": "GenuineIntel", "cpu_model": "Intel(R) Xeon(R) Processor"}
AMD = {"isa": "AVX2", "cpu_vendor": "AuthenticAMD", "cpu_model": "AMD EPYC"}


def test_one_code_version_on_two_cpu_kinds_with_each_seed_on_one_is_a_blocked_grid(tmp_path):
    for seed, cpu in ((0, INTEL), (1, INTEL), (2, AMD)):
        _store(tmp_path, "sync", 0, seed, 1.0 + seed, prov={**_prov("5"), **cpu})
        _store(tmp_path, "stale", 2, seed, 5.0 + seed, prov={**_prov("5"), **cpu})
    summary = build_report(tmp_path)["summary"]
    assert len(summary["versions"]) == 2  # the environment keys name the CPU kind
    blocks = summary["machine_blocks"]
    assert blocks == {"kinds": {"AMD EPYC AVX2": {"seeds": {"quadratic": [2]}, "cells": 2},
                                "Intel(R) Xeon(R) Processor AVX512": {"seeds": {"quadratic": [0, 1]}, "cells": 4}},
                      "mixed_seeds": [], "code_versions": [environment_key(_prov("5"))], "blocked": True}
    top = (tmp_path / "summary.md").read_text().split("\n## ")[0]
    assert "**The cells ran on 2 CPU kinds, each seed on one** (AMD EPYC AVX2: quadratic seeds 2 (2 cells); " \
           "Intel(R) Xeon(R) Processor AVX512: quadratic seeds 0, 1 (4 cells)), in one code version." in top
    assert "mixes" not in top


@pytest.mark.parametrize("edited", [False, True])
def test_a_blocked_grid_whose_seeds_ran_different_plugin_code_is_not_blocked(tmp_path, edited):
    """Each seed on one CPU kind, a plug-in method beside sync and stale: one code version on two kinds, blocked,
    while the plug-in's code is one; where the second machine's plug-in was edited, the plug-in group mixes code:
    not blocked, and the summary names the grid as mixing versions at its top."""
    damp = {"damp": {"distribution": "damp", "version": "0.1", "sha256": "a" * 64}}
    for seed, cpu in ((0, INTEL), (1, AMD)):
        for method, s in (("sync", 0), ("stale", 2), ("damp", 2)):
            plugins = {"plugins": {"damp": {**damp["damp"], "sha256": ("b" if edited and seed else "a") * 64}}}
            _store(tmp_path, method, s, seed, 1.0 + seed, prov={**_prov("5"), **cpu,
                                                                 **(plugins if method == "damp" else {})})
    summary = build_report(tmp_path)["summary"]
    assert summary["machine_blocks"]["blocked"] is not edited
    md = (tmp_path / "summary.md").read_text().split("\n## ")[0]
    assert ("**This grid mixes 2 code versions**" in md and "quadratic / damp / s=2" in md) is edited
    assert ("**The cells ran on 2 CPU kinds, each seed on one**" in md) is not edited


def test_a_seed_on_two_cpu_kinds_or_two_code_versions_on_two_kinds_is_not_blocked(tmp_path):
    _store(tmp_path, "sync", 0, 0, 1.0, prov={**_prov("5"), **INTEL})
    _store(tmp_path, "stale", 2, 0, 5.0, prov={**_prov("5"), **AMD})  # seed 0's pair split across machines
    summary = build_report(tmp_path)["summary"]
    assert summary["machine_blocks"]["mixed_seeds"] == [
        {"task": "quadratic", "seed": 0, "kinds": ["AMD EPYC AVX2", "Intel(R) Xeon(R) Processor AVX512"]}]
    assert not summary["machine_blocks"]["blocked"]
    md = (tmp_path / "summary.md").read_text()
    assert "**This grid mixes 2 code versions**" in md.split("\n## ")[0]
    assert "Seeds computed on more than one CPU kind (their methods are not compared on one machine): quadratic " \
           "seed 0 (AMD EPYC AVX2 and Intel(R) Xeon(R) Processor AVX512)." in md
    # cells stored before the CPU's vendor was recorded: one environment key for both kinds, the seed still named
    unnamed = tmp_path / "unnamed"
    for cpu, method, s in ((INTEL, "sync", 0), (AMD, "stale", 2)):
        _store(unnamed, method, s, 0, 1.0 + s, prov={**_prov("5"), "isa": "AVX2", "cpu_model": cpu["cpu_model"]})
    summary = build_report(unnamed)["summary"]
    assert len(summary["versions"]) == 1 and summary["machine_blocks"]["mixed_seeds"]
    top = (unnamed / "summary.md").read_text().split("\n## ")[0]
    assert "**Seeds computed on more than one CPU kind (their methods are not compared on one machine): quadratic " \
           "seed 0 (AMD EPYC AVX2 and Intel(R) Xeon(R) Processor AVX2).**" in top
    other = tmp_path / "other"
    _store(other, "sync", 0, 0, 1.0, prov={**_prov("5"), **INTEL})
    _store(other, "sync", 0, 1, 1.0, prov={**_prov("6"), **AMD})  # another library source on the other machine
    blocks = build_report(other)["summary"]["machine_blocks"]
    assert len(blocks["code_versions"]) == 2 and not blocks["mixed_seeds"] and not blocks["blocked"]


def test_one_cpu_kind_has_no_machine_blocks(tmp_path):
    for seed in (0, 1):
        _store(tmp_path, "sync", 0, seed, 1.0, prov={**_prov("5"), **AMD})
    assert "machine_blocks" not in build_report(tmp_path)["summary"]


FAKE_GACBENCH = '''#!{python}
"""gacbench bench --out DIR stand-in: the summary of a grid of one code version, of two when FAKE_MIXED=1, without
versions when FAKE_MIXED=none; each call's arguments are appended to DIR/calls."""
import json
import os
import sys
from pathlib import Path

out = Path(sys.argv[sys.argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
with open(out / "calls", "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
versions = [{{"key": "src 111", "description": "commit aaaaaaaaaa", "cells": 3}}]
summary = {{"versions": versions}}
if os.environ["FAKE_MIXED"] == "1":
    versions.append({{"key": "src 222", "description": "commit bbbbbbbbbb (dirty)", "cells": 1}})
elif os.environ["FAKE_MIXED"] == "plugin":  # one library version; a group's seeds ran two codes of a plug-in
    summary["mixed_version_groups"] = [{{"task": "t", "method": "damp", "staleness": 4,
                                        "versions": ["src 111 plugin damp aaa", "src 111 plugin damp bbb"]}}]
elif os.environ["FAKE_MIXED"] in ("blocked", "seeds", "seeds-one-key"):  # one code version on two CPU kinds
    if os.environ["FAKE_MIXED"] != "seeds-one-key":  # else cells stored without the vendor: one key for both kinds
        versions.append({{"key": "src 111 isa AVX2", "description": "commit aaaaaaaaaa", "cells": 2}})
    blocked = os.environ["FAKE_MIXED"] == "blocked"
    summary["machine_blocks"] = {{
        "kinds": {{"Intel Xeon AVX512": {{"seeds": {{"t": [0, 1]}}, "cells": 3}},
                  "AMD EPYC AVX2": {{"seeds": {{"t": [2] if blocked else [1, 2]}}, "cells": 2}}}},
        "mixed_seeds": [] if blocked else [{{"task": "t", "seed": 1, "kinds": ["AMD EPYC AVX2", "Intel Xeon AVX512"]}}],
        "code_versions": ["src 111"], "blocked": blocked}}
(out / "summary.json").write_text(json.dumps({{}} if os.environ["FAKE_MIXED"] == "none" else summary))
(out / "summary.md").write_text("mixed" if len(versions) > 1 else "single")
(out / "fig_x.png").write_bytes(b"png")
if os.environ.get("FAKE_INPUT_AFTER") == "1":  # a cell written after the figures were drawn
    (out / "cells" / "t" / "m" / "s0" / "seed0").mkdir(parents=True, exist_ok=True)
    (out / "cells" / "t" / "m" / "s0" / "seed0" / "status.json").write_text("{{}}")
    os.utime(out / "cells" / "t" / "m" / "s0" / "seed0" / "status.json",
             ns=((out / "fig_x.png").stat().st_mtime_ns + 10**9,) * 2)
'''


def _make_sh(tmp_path, *args: str, mixed: bool | str, allow_env: str | None = None, suite: str = "grid",
             input_after: bool = False):
    """Run a copy of paper/make.sh in ``tmp_path`` on the grid ``suite`` that FAKE_GACBENCH computes."""
    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "paper").mkdir(parents=True, exist_ok=True)
    shutil.copy(repo / "paper" / "make.sh", tmp_path / "paper" / "make.sh")
    fake = tmp_path / "fake-gacbench"
    fake.write_text(FAKE_GACBENCH.format(python=sys.executable))
    fake.chmod(0o755)
    env = {**os.environ, "GACBENCH": str(fake), "PYTHON": sys.executable,
           "FAKE_MIXED": mixed if isinstance(mixed, str) else str(int(mixed)),
           "FAKE_INPUT_AFTER": str(int(input_after))}
    env.pop("GACBENCH_ALLOW_MIXED_VERSIONS", None)
    if allow_env is not None:
        env["GACBENCH_ALLOW_MIXED_VERSIONS"] = allow_env
    return subprocess.run(["bash", str(tmp_path / "paper" / "make.sh"), *args, suite], env=env, capture_output=True,
                          text=True, timeout=120)


def test_make_sh_publishes_a_single_version_grid(tmp_path):
    (tmp_path / "paper" / "grid").mkdir(parents=True)
    (tmp_path / "paper" / "grid" / "fig_old.png").write_bytes(b"a figure the grid no longer draws")
    proc = _make_sh(tmp_path, mixed=False)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (tmp_path / "paper" / "grid").iterdir()) == ["fig_x.png", "summary.json",
                                                                                "summary.md"]


def test_make_sh_never_publishes_a_figure_the_report_did_not_redraw(tmp_path):
    runs = tmp_path / "grids" / "grid"
    runs.mkdir(parents=True)
    (runs / "fig_gone.png").write_bytes(b"drawn by an earlier report, from other cells")
    proc = _make_sh(tmp_path, mixed=False)
    assert proc.returncode == 0, proc.stderr
    assert not (runs / "fig_gone.png").exists() and not (tmp_path / "paper" / "grid" / "fig_gone.png").exists()
    proc = _make_sh(tmp_path / "late", mixed=False, input_after=True)
    assert proc.returncode != 0
    assert "is older than its input grids/grid/cells/t/m/s0/seed0/status.json; not published" in proc.stderr
    assert "gacbench report grids/grid" in proc.stderr
    assert not (tmp_path / "late" / "paper" / "grid").exists()


def test_make_sh_refuses_a_mixed_grid_unless_allowed(tmp_path):
    proc = _make_sh(tmp_path, mixed=True)
    assert proc.returncode != 0
    assert "grids/grid/summary.json mixes 2 code versions (commit aaaaaaaaaa (3 cells): src 111; commit " \
           "bbbbbbbbbb (dirty) (1 cells): src 222); not published" in proc.stderr
    assert "--allow-mixed-versions" in proc.stderr
    assert not (tmp_path / "paper" / "grid").exists()  # nothing published
    proc = _make_sh(tmp_path / "flag", "--allow-mixed-versions", mixed=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "flag" / "paper" / "grid" / "summary.md").read_text() == "mixed"
    assert _make_sh(tmp_path / "env", mixed=True, allow_env="1").returncode == 0


def test_make_sh_publishes_one_code_version_on_two_cpu_kinds_only_when_each_seed_is_on_one(tmp_path):
    proc = _make_sh(tmp_path, mixed="blocked")
    assert proc.returncode == 0, proc.stderr
    assert "grids/grid/summary.json: one code version on 2 CPU kinds, each seed on one (Intel Xeon AVX512: 3 " \
           "cells; AMD EPYC AVX2: 2 cells)" in proc.stderr
    assert (tmp_path / "paper" / "grid" / "summary.json").exists()
    for mixed in ("seeds", "seeds-one-key"):  # whether or not the environment keys name the kinds
        proc = _make_sh(tmp_path / mixed, mixed=mixed)
        assert proc.returncode != 0
        assert "seeds computed on more than one CPU kind: t seed 1 (AMD EPYC AVX2 and Intel Xeon AVX512); not " \
               "published" in proc.stderr and "--allow-mixed-versions" in proc.stderr
        assert not (tmp_path / mixed / "paper" / "grid").exists()
    assert _make_sh(tmp_path / "allowed", "--allow-mixed-versions", mixed="seeds-one-key").returncode == 0


def test_make_sh_refuses_a_grid_whose_seeds_ran_different_plugin_code_unless_allowed(tmp_path):
    proc = _make_sh(tmp_path, mixed="plugin")
    assert proc.returncode != 0
    assert ("grids/grid/summary.json: groups whose seeds ran different code (t / damp / s=4: a stabilizer plug-in's"
            in proc.stderr and "--allow-mixed-versions" in proc.stderr)
    assert not (tmp_path / "paper" / "grid").exists()
    assert _make_sh(tmp_path / "allowed", "--allow-mixed-versions", mixed="plugin").returncode == 0


def test_make_sh_refuses_a_summary_without_versions(tmp_path):
    proc = _make_sh(tmp_path, mixed="none")
    assert proc.returncode != 0
    assert "grids/grid/summary.json lists no code versions; rebuild it with gacbench report grids/grid" in proc.stderr
    assert not (tmp_path / "paper" / "grid").exists()


def test_table3_reports_only_the_thresholds_calibrated_from_gradient_cosines():
    """gac-step-calibrated's thresholds come from the step cosines, so Table 3 (gradient cosines) leaves them out."""
    from gacbench.bench.tables import _table3

    def cell(method, **kw):
        return {"task": "t", "method": method, "staleness": 0 if method == "sync" else 16, "seed": 0,
                "status": "done", **kw}

    cells = [cell("sync", cos_abs_q90=0.2, cos_max_abs=0.5, cos_abs_le_005=0.3, cos_median=0.01),
             cell("gac-calibrated", c_low=0.2, c_high=0.5), cell("gac-step-calibrated", c_low=0.9, c_high=0.97)]
    row = next(line for line in _table3(cells) if line.startswith("| t |"))
    assert "| (0.2, 0.5) over 1 cells |" in row


def test_the_update_diagnostics_table_has_the_ess_column_where_cells_log_it(tmp_path):
    """is/ess_frac ((Σw)²/(NΣw²), logged by GRPO) is averaged after the warm-up like the other diagnostics."""
    cell = _store(tmp_path, "stale", 2, 0, 1.0)
    d = cell_dir(tmp_path, cell)
    ess = [1.0, 0.9, 0.6, 0.5]
    (d / "metrics.csv").write_text("step,eval/gap,align/cos,is/ess_frac\n"
                                   + "".join(f"{t},1.0,0.1,{e}\n" for t, e in enumerate(ess)))
    config = json.loads((d / "config.json").read_text())
    write_json(d / "config.json", {**config, "warmup": 2})
    rep = build_report(tmp_path)
    (rec,) = rep["summary"]["cells"]
    assert rec["ess_frac"] == pytest.approx((0.6 + 0.5) / 2)  # the steps after the warm-up
    md = (tmp_path / "summary.md").read_text()
    assert "| ESS fraction of the token weights |" in md and "| 0.55 |" in md


def test_make_sh_runs_llm_length_with_sync_and_stale_on_five_seeds(tmp_path):
    """paper/make.sh llm-length runs the suite, then sync and stale at seeds 3 and 4 into the same store, and
    publishes the one summary of both."""
    proc = _make_sh(tmp_path, mixed=False, suite="llm-length")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "grids" / "llm-length" / "calls").read_text().splitlines() == [
        "bench --suite llm-length --out grids/llm-length",
        "bench --suite llm-length --methods sync,stale --seeds 3,4 --out grids/llm-length"]
    assert (tmp_path / "paper" / "llm-length" / "summary.md").is_file()
