"""The pinned start points (θ₀): the shipped checkpoints hash to their pins, every shipped LLM suite names the pin
of its start point, a build that hashes elsewhere is refused, and a grid refuses stored cells from another θ₀."""

import re
from pathlib import Path

import pytest
import yaml

from gacbench.llm import pinned
from gacbench.provenance import weights_sha256
from gacbench.usage import UsageError

REPO = Path(__file__).resolve().parents[1]
SUITES = sorted((REPO / "tasks" / "suites").glob("*.yaml"))


def _fake_checkpoint(path: Path, content: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(content)
    return path


@pytest.mark.parametrize("name", sorted(pinned.PINNED))
def test_every_pinned_start_point_ships_with_its_hash(name):
    """The shipped files are the pinned bits: the same hash on any machine, since nothing is rebuilt."""
    path = pinned.models_root() / name
    assert (path / "config.json").exists(), f"{path} is not shipped"
    assert weights_sha256(path) == pinned.PINNED[name]
    assert pinned.spec_sha256(path) == pinned.PINNED_SPEC[name]  # its configuration and tokenizer too


def test_a_copy_with_the_pinned_weights_but_another_config_or_vocabulary_is_refused(tmp_path, monkeypatch):
    import json
    import shutil

    name = "warm-dd5cd00b44e5fa65-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0"
    shipped = pinned.models_root() / name
    models = tmp_path / "models"
    monkeypatch.setenv("GACBENCH_MODELS", str(models))
    monkeypatch.setattr(pinned, "_checked", {})
    monkeypatch.setattr(pinned, "_checked_spec", {})
    copy = models / name
    shutil.copytree(shipped, copy)

    def build():
        raise AssertionError("a shipped start point is never rebuilt")

    assert pinned.resolve(name, build) == copy  # an exact copy is the pinned θ₀
    config = json.loads((copy / "config.json").read_text())
    config.get("rope_parameters", config)["rope_theta"] = 10.0  # the weights stay as they are
    (copy / "config.json").write_text(json.dumps(config))
    pinned._checked_spec.clear()
    with pytest.raises(UsageError, match="has the pinned weights, but its config.json, tokenizer or generation_config"):
        pinned.resolve(name, build)
    shutil.copy(shipped / "config.json", copy / "config.json")
    tokenizer = json.loads((copy / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]  # two digits' ids swapped
    (copy / "tokenizer.json").write_text(json.dumps(tokenizer))
    pinned._checked_spec.clear()
    with pytest.raises(UsageError, match="tokenizer or generation_config.json computes otherwise"):
        pinned.resolve(name, build)
    shutil.copy(shipped / "tokenizer.json", copy / "tokenizer.json")
    generation = json.loads((copy / "generation_config.json").read_text())
    generation["eos_token_id"] = [2, 5]  # another end token: the engines would end completions there too
    (copy / "generation_config.json").write_text(json.dumps(generation))
    pinned._checked_spec.clear()
    with pytest.raises(UsageError, match="tokenizer or generation_config.json computes otherwise"):
        pinned.resolve(name, build)


@pytest.mark.parametrize("suite", [s for s in SUITES if "grpo" in s.read_text()], ids=lambda p: p.stem)
def test_every_shipped_llm_suite_pins_the_theta0_of_its_start_point(suite):
    from gacbench.llm.warmstart import start_point

    spec = yaml.safe_load(suite.read_text())
    for task, t in spec["tasks"].items():
        if t["objective"] != "grpo":
            continue
        name = start_point(t.get("params", {}))[0]
        assert name in pinned.PINNED, f"{suite.stem}/{task}: start point {name} has no pin"
        assert pinned.PINNED[name].startswith(t.get("theta0", "<missing>")), f"{suite.stem}/{task}: theta0"


@pytest.mark.parametrize("params", [{}, {"model": {"warm_steps": 50}, "task": {"max_ops": 1, "max_operand": 4}},
                                    {"task": {"name": "scratchpad", "options": {"max_operand": 5}}}])
def test_the_start_point_a_suite_pins_is_the_directory_a_run_loads(params, monkeypatch):
    from gacbench.llm import warmstart
    from gacbench.llm.tasks import TaskConfig

    monkeypatch.setattr(warmstart, "warm_started_dir", lambda config, task, steps: Path(warmstart.warm_key(
        config, task, steps)))
    model = params.get("model", {})
    loaded = warmstart.built_in_model_dir(model.get("size", "tiny"), model.get("warm_steps", 400),
                                          TaskConfig(**params.get("task", {})))
    assert loaded.name == warmstart.start_point(params)[0]


def test_a_pinned_start_point_is_the_shipped_directory_without_a_build(tmp_path, monkeypatch):
    shipped = _fake_checkpoint(tmp_path / "models" / "warm-x", b"weights")
    monkeypatch.setenv("GACBENCH_MODELS", str(tmp_path / "models"))
    monkeypatch.setitem(pinned.PINNED, "warm-x", weights_sha256(shipped))

    def build():
        raise AssertionError("a shipped start point is never rebuilt")

    assert pinned.resolve("warm-x", build) == shipped


def test_a_build_that_hashes_elsewhere_is_refused_naming_both_hashes(tmp_path, monkeypatch):
    monkeypatch.setenv("GACBENCH_MODELS", str(tmp_path / "none"))
    built = _fake_checkpoint(tmp_path / "cache" / "warm-y", b"rounded on another instruction set")
    monkeypatch.setitem(pinned.PINNED, "warm-y", "ab" * 32)
    with pytest.raises(UsageError, match=r"warm-y: .*, built on this machine \(.*instruction set .*\), has weights "
                                         r"SHA-256 [0-9a-f]{16}\.\.\., the pinned θ₀ is abababababababab\.\.\. \(built "
                                         r"on an Intel Xeon"):
        pinned.resolve("warm-y", lambda: built)
    monkeypatch.setitem(pinned.PINNED, "warm-y", weights_sha256(built))
    pinned._checked.clear()
    assert pinned.resolve("warm-y", lambda: built) == built  # the same bits built here are accepted
    assert pinned.resolve("warm-unpinned", lambda: built) == built  # no pin: built and used as before


@pytest.mark.parametrize("value", ["abc", "XYZ123456789abc", 1234567890123, "g" * 12, "0123456789abcdefXYZ",
                                   "0123456789ab-not-a-hash", "a" * 70, "0123456789", "0123456789a", "a" * 65])
def test_a_malformed_theta0_is_refused(tmp_path, value):
    from gacbench.bench.validate import load_suite

    suite = yaml.safe_load((REPO / "tasks" / "suites" / "llm-smoke.yaml").read_text())
    suite["tasks"]["arithmetic"]["theta0"] = value
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(suite))
    with pytest.raises(UsageError, match="theta0: .* hex digits"):
        load_suite(str(path))


def test_a_grid_refuses_stored_cells_that_started_from_another_theta0(tmp_path, monkeypatch):
    from gacbench.bench import cell
    from gacbench.bench.cell import cell_dir
    from gacbench.bench.runner import expand_cells
    from gacbench.bench.theta0 import check_theta0
    from gacbench.bench.validate import load_suite
    from gacbench.jsonio import write_json

    suite = load_suite("llm-smoke")
    cells = expand_cells(suite, methods=["sync"], seeds=[0])
    pin = check_theta0(suite, cells, tmp_path)["arithmetic"]
    for piece in (pin[8:24], pin[1:17]):  # a suite's theta0 is a prefix of the pin, not any piece of it
        with pytest.raises(UsageError):
            check_theta0({**suite, "tasks": {"arithmetic": {**suite["tasks"]["arithmetic"], "theta0": piece}}},
                         cells, tmp_path)
    d = cell_dir(tmp_path, cells[0])
    d.mkdir(parents=True)
    monkeypatch.setattr(cell, "stored_done", lambda root, c: {"status": "done"} if c == cells[0] else None)
    write_json(d / "config.json", {**cells[0], "provenance": {"initial_weights": pin}})
    check_theta0(suite, cells, tmp_path)  # its own θ₀: accepted
    write_json(d / "config.json", {**cells[0], "provenance": {"initial_weights": "0" * 64}})
    with pytest.raises(UsageError, match=r"1 stored cell\(s\) of task 'arithmetic' .* another θ₀ .* 0000000000000000"):
        check_theta0(suite, cells, tmp_path)
    with pytest.raises(UsageError, match="another θ₀"):  # the done cells as the grid runner read them
        check_theta0(suite, cells, tmp_path, cell.stored_done_files(tmp_path, cells))
    check_theta0(suite, cells, tmp_path, {})  # none done when they were read: nothing is read again
    write_json(d / "config.json", {**cells[0]})  # no recorded weights: accepted (identified by its rewards)
    check_theta0(suite, cells, tmp_path)
    write_json(d / "config.json", {**cells[0], "provenance": {"initial_weights": pin[:12] + "f" * 52}})
    with pytest.raises(UsageError, match="another θ₀"):  # the whole hash must match, not the pin's first digits
        check_theta0(suite, cells, tmp_path)


def _seed0_stored_beside_a_seed1_grid(tmp_path):
    """llm-smoke's sync cells of seeds 0 and 1, the pin of their θ₀, and the directory of a done seed-0 cell stored
    in ``tmp_path`` from that θ₀ (the seed-1 grid's outside cell)."""
    from gacbench.bench.cell import cell_dir
    from gacbench.bench.runner import expand_cells
    from gacbench.bench.theta0 import check_theta0
    from gacbench.bench.validate import load_suite
    from gacbench.jsonio import write_json

    suite = load_suite("llm-smoke")
    seed0, seed1 = (expand_cells(suite, methods=["sync"], seeds=[s]) for s in (0, 1))
    pin = check_theta0(suite, seed1, tmp_path)["arithmetic"]
    d = cell_dir(tmp_path, seed0[0])
    d.mkdir(parents=True)
    write_json(d / "status.json", {"status": "done", "initial": 0.1, "final": 0.2, "diverged": False,
                                   "metric": "reward", "higher_is_better": True, "steps_run": 2, "cell": seed0[0]})
    (d / "metrics.csv").write_text("reward/mean,step\n0.1,0\n0.2,1\n")
    write_json(d / "config.json", {**seed0[0], "provenance": {"initial_weights": pin}})
    return suite, seed0, seed1, pin, d


def test_a_grid_refuses_another_seed_s_stored_cell_that_started_from_another_theta0(tmp_path):
    """A done cell of the task outside the grid (seed 0, the grid runs seed 1) joins the task's summary: from
    another θ₀ it is refused before anything runs."""
    from gacbench.bench.theta0 import check_theta0
    from gacbench.jsonio import write_json

    suite, seed0, seed1, pin, d = _seed0_stored_beside_a_seed1_grid(tmp_path)
    check_theta0(suite, seed1, tmp_path)  # the same θ₀: accepted
    write_json(d / "config.json", {**seed0[0], "provenance": {"initial_weights": "0" * 64}})
    with pytest.raises(UsageError, match=r"1 stored cell\(s\) of task 'arithmetic' .* seed 0: 0000000000000000"):
        check_theta0(suite, seed1, tmp_path)


def test_the_two_checks_before_a_grid_read_a_stored_cell_outside_it_once(tmp_path, monkeypatch):
    """check_theta0 and check_stored both compare the grid with the task's done cells outside it (seed 0, the grid
    runs seed 1): given the grid's stored_done_files, they read each such cell once between them."""
    from gacbench.bench import cell
    from gacbench.bench.cell import CellMismatchError
    from gacbench.bench.runner import check_stored
    from gacbench.bench.theta0 import check_theta0
    from gacbench.jsonio import write_json

    suite, seed0, seed1, pin, d = _seed0_stored_beside_a_seed1_grid(tmp_path)
    read = []
    done_problem = cell.done_problem
    monkeypatch.setattr(cell, "done_problem", lambda path, status: read.append(path) or done_problem(path, status))
    stored = cell.stored_done_files(tmp_path, seed1)
    assert check_theta0(suite, seed1, tmp_path, stored) == {"arithmetic": pin}
    check_stored(seed1, tmp_path, stored)
    assert read == [d]
    read.clear()  # without the grid's read, each check reads it itself
    check_theta0(suite, seed1, tmp_path)
    check_stored(seed1, tmp_path)
    assert read == [d, d]
    # the read of a larger grid (seeds 0 and 1) holds no outside cell of the seed-1 grid: not used for it, so the
    # seed-0 cell, stored with other steps, is still refused
    write_json(d / "status.json", {"status": "done", "initial": 0.1, "final": 0.2, "diverged": False,
                                   "metric": "reward", "higher_is_better": True, "steps_run": 2,
                                   "cell": {**seed0[0], "steps": seed0[0]["steps"] + 1}})
    with pytest.raises(CellMismatchError, match="steps"):
        check_stored(seed1, tmp_path, cell.stored_done_files(tmp_path, seed0 + seed1))


def test_a_stored_cell_of_another_start_point_is_left_to_the_one_setting_per_task_check(tmp_path):
    """A done cell of the task computed from another start point (another warm-up length) started from other
    weights by construction: check_theta0 leaves it alone, and the grid's one-setting-per-task check refuses it,
    naming the setting that differs."""
    from gacbench.bench.cell import CellMismatchError, cell_dir
    from gacbench.bench.runner import check_stored, expand_cells
    from gacbench.bench.theta0 import check_theta0
    from gacbench.bench.validate import load_suite, merge_params, parse_params
    from gacbench.jsonio import write_json

    suite = load_suite("llm-smoke")
    seed1 = expand_cells(suite, methods=["sync"], seeds=[1])
    other = [{**c, "params": merge_params(c["params"], parse_params(["model.warm_steps=300"]))}
             for c in expand_cells(suite, methods=["sync"], seeds=[0])]
    d = cell_dir(tmp_path, other[0])
    d.mkdir(parents=True)
    write_json(d / "status.json", {"status": "done", "initial": 0.1, "final": 0.2, "diverged": False,
                                   "metric": "reward", "higher_is_better": True, "steps_run": 2, "cell": other[0]})
    (d / "metrics.csv").write_text("reward/mean,step\n0.1,0\n0.2,1\n")
    write_json(d / "config.json", {**other[0], "provenance": {"initial_weights": "0" * 64}})
    assert set(check_theta0(suite, seed1, tmp_path)) == {"arithmetic"}
    with pytest.raises(CellMismatchError, match="warm_steps"):
        check_stored(seed1, tmp_path)


@pytest.mark.parametrize("param,checked", [("model.gradient_checkpointing=true", True), ("task.reward=exact", True),
                                           ("model.size=tiny", True), ("model.warm_steps=300", False),
                                           ("task.max_operand=8", False), ("task.eval_fraction=0.3", False),
                                           ("task.eval_fraction=0.1", True)])
def test_a_param_that_leaves_the_start_point_where_it_is_keeps_the_theta0_check(tmp_path, monkeypatch, param,
                                                                                   checked):
    from gacbench.bench import cell
    from gacbench.bench.cell import cell_dir
    from gacbench.bench.runner import expand_cells
    from gacbench.bench.theta0 import check_theta0
    from gacbench.bench.validate import load_suite, merge_params, parse_params
    from gacbench.jsonio import write_json

    suite = load_suite("llm-smoke")
    over = parse_params([param])
    cells = [{**c, "params": merge_params(c["params"], over)} for c in expand_cells(suite, methods=["sync"], seeds=[0])]
    d = cell_dir(tmp_path, cells[0])
    d.mkdir(parents=True)
    monkeypatch.setattr(cell, "stored_done", lambda root, c: {"status": "done"} if c == cells[0] else None)
    write_json(d / "config.json", {**cells[0], "provenance": {"initial_weights": "0" * 64}})
    if checked:  # the same start point: the suite's pin applies and the stored cell from another θ₀ is refused
        with pytest.raises(UsageError, match="another θ₀"):
            check_theta0(suite, cells, tmp_path)
    else:  # another start point: the suite's theta0 does not describe it
        assert check_theta0(suite, cells, tmp_path) == {}


def test_warm_start_prints_both_hashes_beside_their_pins_and_fails_when_one_differs(tmp_path, monkeypatch, capsys):
    import json
    import shutil

    from gacbench.bench import warm_start
    from gacbench.cli import main

    edit = {}

    def copy_of_the_shipped(path, config, task, steps, cache_dir):  # stands for the build: the pinned bits
        shutil.copytree(pinned.models_root() / path.name, path)
        if edit:
            (path / "config.json").write_text(json.dumps({**json.loads((path / "config.json").read_text()), **edit}))

    monkeypatch.setattr(warm_start, "build_warm_start", copy_of_the_shipped)
    assert main(["warm-start", "--suite", "llm-smoke", "--out", str(tmp_path / "a")]) == 0
    said = capsys.readouterr().out
    assert said.count(" = the pin") == 2 and "configuration, vocabulary and end tokens SHA-256" in said
    edit["rms_norm_eps"] = 1e-3  # the same weights, another computation
    assert main(["warm-start", "--suite", "llm-smoke", "--out", str(tmp_path / "b")]) == 1
    said = capsys.readouterr().out
    assert "weights SHA-256" in said and said.count(" = the pin") == 1 and " != the pin" in said


@pytest.mark.parametrize("old", [None, "4.57.1"])
def test_a_start_point_without_a_pin_names_the_suite_or_an_old_transformers(monkeypatch, tmp_path, old):
    """The start points' names hash transformers 5's serialisation of their configuration: under transformers 4 none
    finds its pin, and the refusal says so instead of blaming the suite."""
    from gacbench.bench.runner import expand_cells
    from gacbench.bench.theta0 import check_theta0
    from gacbench.bench.validate import load_suite

    suite = load_suite("llm-smoke")
    cells = expand_cells(suite, methods=["sync"], seeds=[0])
    monkeypatch.setattr(pinned, "pin_of", lambda name: None)
    monkeypatch.setattr(pinned, "transformers_too_old", lambda: old)
    fix = "install transformers>=5" if old else "fix the suite's theta0: (or the pin)"
    with pytest.raises(UsageError, match=r"has no pin in gacbench.llm.pinned; .*" + re.escape(fix)):
        check_theta0(suite, cells, tmp_path)


def test_transformers_too_old_reads_the_installed_version(monkeypatch):
    from importlib import metadata

    for version, expected in (("4.57.1", "4.57.1"), ("5.19.0", None), ("5.0.0rc1", None)):
        monkeypatch.setattr(metadata, "version", lambda name, v=version: v)
        assert pinned.transformers_too_old() == expected


def test_a_damaged_shipped_checkpoint_is_named_with_the_fix(tmp_path, monkeypatch):
    """A shipped start point whose weight file changed (or that gained another weight file), or whose config.json
    is cut off, is refused naming the files and how to restore them, not blamed on the machine's rounding."""
    import shutil

    name = "warm-dd5cd00b44e5fa65-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0"
    models = tmp_path / "models"
    monkeypatch.setenv("GACBENCH_MODELS", str(models))
    copy = models / name
    shutil.copytree(REPO / "tasks" / "models" / name, copy)

    def build():
        raise AssertionError("a shipped start point is never rebuilt")

    for damage in ("extra", "flip"):
        monkeypatch.setattr(pinned, "_checked", {})
        monkeypatch.setattr(pinned, "_checked_spec", {})
        if damage == "extra":
            (copy / "training_args.bin").write_bytes(b"not weights")
            files = "model.safetensors, training_args.bin"
        else:
            (copy / "training_args.bin").unlink()
            data = bytearray((copy / "model.safetensors").read_bytes())
            data[-1] ^= 1
            (copy / "model.safetensors").write_bytes(bytes(data))
            files = "model.safetensors"
        with pytest.raises(UsageError, match=rf"the shipped checkpoint .* over {re.escape(files)}, the pin is .*: a "
                                             r"damaged or edited copy .*; copy it again from the repository's "
                                             rf"tasks/models/{name}, and remove"):
            pinned.resolve(name, build)
    shutil.copy(REPO / "tasks" / "models" / name / "model.safetensors", copy / "model.safetensors")
    (copy / "config.json").write_text((copy / "config.json").read_text()[:40])
    monkeypatch.setattr(pinned, "_checked", {})
    monkeypatch.setattr(pinned, "_checked_spec", {})
    with pytest.raises(UsageError, match=r"config.json, tokenizer or generation_config.json cannot be read .*; copy "
                                         r"it again from the repository's"):
        pinned.resolve(name, build)
    # the repository's own copy (GACBENCH_MODELS unset): restored from git, in that repository
    assert pinned._restore(REPO / "tasks" / "models" / name, name) == (
        f"restore it (git -C {REPO} checkout -- tasks/models/{name})")


def test_a_grid_names_a_damaged_shipped_start_point_before_any_cell_runs(tmp_path, monkeypatch, capsys):
    import shutil

    from gacbench.cli import main

    name = "warm-dd5cd00b44e5fa65-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0"
    models = tmp_path / "models"
    monkeypatch.setenv("GACBENCH_MODELS", str(models))
    monkeypatch.setattr(pinned, "_checked", {})
    monkeypatch.setattr(pinned, "_checked_spec", {})
    shutil.copytree(REPO / "tasks" / "models", models)
    (models / name / "training_args.bin").write_bytes(b"not weights")
    out = tmp_path / "out"
    assert main(["bench", "--suite", "llm-smoke", "--methods", "sync", "--seeds", "0", "--out", str(out),
                 "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the shipped checkpoint" in err[0] and "a damaged or edited copy" in err[0], err
    assert not list(out.glob("cells/**/status.json"))
