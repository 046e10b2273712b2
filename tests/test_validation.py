"""The one validation step that a bench cell and the runner share: an objective's ``check_settings`` (which its
constructor runs), the methods built once and read in canonical form. A setting or method a cell would refuse is
refused before anything runs, in one line, exit status 2."""

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from gacbench.bench.runner import SUITES_DIR, expand_cells
from gacbench.bench.validate import load_suite, parse_methods
from gacbench.cli import main
from gacbench.methods import canonical_method, method_callbacks
from gacbench.objectives import objective_class
from gacbench.objectives.base import SettingError


def tiny_suite(tmp_path: Path, **over) -> Path:
    suite = {
        "name": "tiny", "steps": 30, "warmup": 5,
        "tasks": {"quadratic": {"objective": "quadratic", "params": {"optimizer": "sgd", "lr": 0.1}},
                  "bandit": {"objective": "bandit", "params": {"lr": 0.05}}},
        "methods": ["sync", "stale", "gac"], "staleness": [0, 4], "seeds": [0],
    }
    suite.update(over)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def refused(capsys, tmp_path: Path, *args: str) -> str:
    """Run ``gacbench bench ARGS``: it must exit 2 with one error line and make no output directory."""
    out = tmp_path / "out"
    assert main(["bench", *args, "--out", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gacbench bench: error: "), err
    assert not out.exists()
    return lines[0]


# -- 1. every setting a cell would refuse is refused before anything runs ---------------------------------------
GRPO_CASES = [
    ("engine.name=foo", "--param engine.name: GRPOModule: engine.name='foo' is not a registered engine (hf, vllm)"),
    ("task.name=foo", "--param task.name: GRPOModule: task.name='foo': unknown task 'foo'; registered tasks: "
                      "arithmetic, math"),
    ("rollout.group=1", "--param rollout.group: GRPOModule: rollout.group=1 must be an integer >= 2"),
    ("rollout.prompts=0", "--param rollout.prompts: GRPOModule: rollout.prompts=0 must be an integer >= 1"),
    ("rollout.max_tokens=0", "--param rollout.max_tokens: GRPOModule: rollout.max_tokens=0 must be an integer >= 1"),
    ("lr=-1", "--param lr: GRPOModule: lr=-1 must be a finite number > 0 (the learning rate)"),
    ("lr=nan", "--param lr: GRPOModule: lr=nan must be a finite number"),
    ("lr=inf", "--param lr: GRPOModule: lr=inf must be a finite number"),
    ("loss.clip_low=2", "--param loss.clip_low: GRPOModule: loss.clip_low=2 must be a finite number in [0, 1)"),
    ("rollout.mode=fast", "--param rollout.mode: GRPOModule: rollout.mode='fast' is not one of sync, async, uniform"),
]


@pytest.mark.parametrize("param,expected", GRPO_CASES)
def test_a_grpo_setting_a_cell_would_refuse_is_refused_before_anything_runs(tmp_path, capsys, param, expected):
    line = refused(capsys, tmp_path, "--suite", "llm-smoke", "--param", param)
    assert expected in line and line.endswith("(task 'arithmetic', objective grpo)")


def test_the_grpo_constructor_runs_the_runners_check_before_loading_anything(monkeypatch):
    from gacbench.llm import grpo, warmstart

    monkeypatch.setattr(grpo, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    monkeypatch.setattr(warmstart, "warm_started_dir", lambda *a, **k: pytest.fail("a model was built"))
    cases = [{"engine": {"name": "foo"}}, {"task": {"name": "foo"}}, {"rollout": {"group": 1}},
             {"loss": {"clip_low": 2.0}}, {"lr": math.nan}, {"lr": math.inf}, {"staleness": -1},
             {"model": {"size": "huge"}}, {"task": {"reward": "nope"}}, {"loss": {"agg": "sum"}}, {"eval_size": 0}]
    for params in cases:
        with pytest.raises(SettingError) as runner:
            grpo.GRPOModule.check_settings(params)
        with pytest.raises(SettingError) as cell:
            grpo.GRPOModule(**params)
        assert str(cell.value) == str(runner.value)
        assert runner.value.key in str(runner.value) and repr(runner.value.value) in str(runner.value)


@pytest.mark.parametrize("name,key,value,message", [
    ("quadratic", "lr", math.nan, "NoisyQuadratic: lr=nan must be a finite number"),
    ("quadratic", "lr", -0.1, "NoisyQuadratic: lr=-0.1 must be a finite number > 0 (the learning rate)"),
    ("quadratic", "kappa", 0.5, "NoisyQuadratic: kappa=0.5 must be a finite number >= 1"),
    ("quadratic", "dim", 1, "NoisyQuadratic: dim=1 has one curvature, L, so its condition number is 1, not kappa=100"),
    ("logistic", "lr", math.inf, "LogisticRegression: lr=inf must be a finite number"),
    ("logistic", "n", 1, "LogisticRegression: n=1 must be an integer >= 2"),
    ("mlp", "lr", -1.0, "MLPClassifier: lr=-1.0 must be a finite number > 0"),
    ("mlp", "optimizer", "adam", "MLPClassifier: optimizer='adam' is not an optimizer of the objectives (adamw, sgd)"),
    ("bandit", "group", 1, "SoftmaxBandit: group=1 must be an integer >= 2"),
    ("bandit", "advantage", "gae", "SoftmaxBandit: advantage='gae': unknown advantage estimator 'gae'"),
    ("sequence", "vocab", 1, "SequencePolicy: vocab=1 must be an integer >= 2"),
    ("sequence", "clip_high", math.inf, "SequencePolicy: clip_high=inf must be a finite number"),
    ("sequence", "clip_low", 1.5, "SequencePolicy: clip_low=1.5 must be a finite number in [0, 1)"),
    ("bandit", "clip_high", -0.3, "SoftmaxBandit: clip_high=-0.3 must be a finite number >= 0"),
    ("quadratic", "seed", 1.5, "NoisyQuadratic: seed=1.5 must be an integer in [0, 4294967295] (it seeds torch's"),
    ("mlp", "seed", "7", "MLPClassifier: seed='7' must be an integer"),
    ("sequence", "seed", True, "SequencePolicy: seed=True must be an integer"),
    ("bandit", "seed", 2**45, "SoftmaxBandit: seed=35184372088832 must be an integer in [0, 4294967295]"),
    ("sequence", "seed", -1, "SequencePolicy: seed=-1 must be an integer in [0, 4294967295]"),
    ("quadratic", "init_scale", "3", "NoisyQuadratic: init_scale='3' must be a finite number >= 0"),
    ("quadratic", "init_scale", -0.5, "NoisyQuadratic: init_scale=-0.5 must be a finite number >= 0"),
    ("logistic", "scale", "3", "LogisticRegression: scale='3' must be a finite number > 0"),
    ("logistic", "scale", 0.0, "LogisticRegression: scale=0.0 must be a finite number > 0"),
    ("bandit", "scale", "x", "SoftmaxBandit: scale='x' must be a finite number > 0"),
    ("bandit", "scale", -3.0, "SoftmaxBandit: scale=-3.0 must be a finite number > 0"),
    ("sequence", "shared_bias", "no", "SequencePolicy: shared_bias='no' must be true or false"),
])
def test_each_synthetic_objective_and_the_runner_refuse_the_same_settings(name, key, value, message):
    cls = objective_class(name)
    with pytest.raises(SettingError, match="^" + re.escape(message)) as runner:
        cls.check_settings({key: value})
    with pytest.raises(SettingError) as cell:
        cls(**{key: value})
    assert str(cell.value) == str(runner.value) and runner.value.key == key


def test_the_largest_seed_runs_and_its_rollout_seeds_fit_torchs_generator():
    import lightning.pytorch as pl
    import torch

    from gacbench.objectives import SequencePolicy, SoftmaxBandit
    from gacbench.objectives.base import SEED_MAX, rollout_seed

    for cls in (SoftmaxBandit, SequencePolicy):
        model = cls(seed=SEED_MAX, steps=3, staleness=1)
        pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                   enable_checkpointing=False).fit(model)
        assert math.isfinite(model.metric())
    for version in (0, 10**17, 10**30):  # any version a run could reach, and beyond
        torch.Generator().manual_seed(rollout_seed(SEED_MAX, version, 7))
    # below 2**64 the rollout seed is the number itself: seeds 0..1000 draw the streams they always drew
    for seed in range(1001):
        for version, salt in ((0, 0), (299, 3), (10**6, 1)):
            assert rollout_seed(seed, version, salt) == seed * 1_000_003 + version * 101 + salt


@pytest.mark.parametrize("param,expected", [
    ("lr=nan", "--param lr: NoisyQuadratic: lr=nan must be a finite number (task 'quadratic', objective quadratic)"),
    ("lr=inf", "--param lr: NoisyQuadratic: lr=inf must be a finite number (task 'quadratic', objective quadratic)"),
    ("group=1", "--param group: SoftmaxBandit: group=1 must be an integer >= 2"),
])
def test_a_synthetic_setting_a_cell_would_refuse_is_refused_before_anything_runs(tmp_path, capsys, param, expected):
    tasks = ["bandit"] if param.startswith("group") else ["quadratic"]
    line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path)), "--tasks", ",".join(tasks),
                   "--param", param)
    assert expected in line


def test_a_bad_setting_in_a_suite_file_is_named_as_the_suites(tmp_path, capsys):
    for params, expected in [({"lr": float("nan")}, "task 'quadratic', objective quadratic: parameter lr (suite): "
                                                    "NoisyQuadratic: lr=nan must be a finite number"),
                             ({"lr": -1.0}, "parameter lr (suite): NoisyQuadratic: lr=-1.0 must be a finite "
                                            "number > 0"),
                             ({"sigma2": float("inf")}, "parameter sigma2 (suite): NoisyQuadratic: sigma2=inf")]:
        suite = tiny_suite(tmp_path, tasks={"quadratic": {"objective": "quadratic", "params": params}})
        assert expected in refused(capsys, tmp_path, "--suite", str(suite))
    ablation = {"staleness": 4, "c_low": [float("nan")], "c_high": [0.3]}
    line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path, ablation=ablation)))
    assert "ablation: c_low: [nan] must be a non-empty list of finite numbers" in line


def test_a_dataset_that_a_cell_could_not_read_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    from gacbench.llm import tasks

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # the settings check stats it; no cell gets to load it
    rows = [{"problem": f"{i}+1", "answer": str(i + 1)} for i in range(12)]
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join([*map(json.dumps, rows[:5]), '{"problem": "2+2"', *map(json.dumps, rows[5:])]) + "\n")
    task = {"objective": "grpo", "params": {"model": {"path": str(model)}, "engine": {"name": "hf"},
                                            "task": {"name": "math", "path": str(data)}}}
    suite = tiny_suite(tmp_path, tasks={"m": task}, staleness=[0, 4, 8], methods=["sync", "stale", "gac"])
    built = []
    factory = tasks.TASKS["math"]
    monkeypatch.setitem(tasks.TASKS, "math", lambda cfg, seed: built.append(cfg.path) or factory(cfg, seed))
    line = refused(capsys, tmp_path, "--suite", str(suite))
    assert line.endswith(f"task 'm', objective grpo: parameter task.path (suite): GRPOModule: task 'math', "
                         f"task.path={str(data)!r}: {data}: line 6: invalid JSON (Expecting ',' delimiter at column "
                         "18); write one JSON object per line"), line
    assert built == [str(data)]  # read once for the grid's 7 cells
    line = refused(capsys, tmp_path, "--suite", str(suite), "--param", f"task.path={tmp_path / 'none.jsonl'}")
    assert line.startswith("gacbench bench: error: --param task.path: ") and "MathDataset: no such file" in line
    data.write_text("\n".join(map(json.dumps, rows)) + "\n")  # the same grid on good rows passes the check
    from gacbench.bench.runner import expand_cells
    from gacbench.bench.validate import check_params

    check_params(expand_cells(load_suite(str(suite))))


def test_a_selected_extra_method_keeps_its_tasks_extra_staleness():
    suite = load_suite("llm-headline")
    full = {c["staleness"] for c in expand_cells(suite) if c["method"] == "gac-skip"}
    chosen = expand_cells(suite, methods=["gac-skip", "gac"])
    assert full == {16, 32} and {c["staleness"] for c in chosen if c["method"] == "gac-skip"} == full
    assert {c["staleness"] for c in chosen if c["method"] == "gac"} == {8, 16, 32}


def test_a_method_that_is_also_an_ablation_cell_is_refused_and_a_reused_cell_keeps_its_own_label(tmp_path, capsys):
    ablation = {"method": "gac", "staleness": 4, "c_low": [0.1], "c_high": [0.2]}
    suite = tiny_suite(tmp_path, ablation=ablation, methods=["sync", "stale"], staleness=[0, 4])
    line = refused(capsys, tmp_path, "--suite", str(suite), "--methods", "sync,stale,gac(c_low=0.1,c_high=0.2),"
                   "ablation")
    assert "method 'gac(c_low=0.1,c_high=0.2)' at staleness 4 is also a cell of the suite's threshold ablation" in line
    # run as a plain method first, then reused by the ablation grid: bench and report label it alike
    out = tmp_path / "grid"
    assert main(["bench", "--suite", str(suite), "--out", str(out), "--workers", "1", "--methods",
                 "sync,stale,gac(c_low=0.1,c_high=0.2)"]) == 0
    assert main(["bench", "--suite", str(suite), "--out", str(out), "--workers", "1"]) == 0
    labels = lambda: {g["method"]: g["ablation"] for g in json.loads((out / "summary.json").read_text())["groups"]}  # noqa: E731
    after_bench = labels()
    assert main(["report", str(out)]) == 0
    assert labels() == after_bench == {"sync": False, "stale": False, "gac(c_low=0.1,c_high=0.2)": False}


# -- 2. method combinations that cannot run ------------------------------------------------------------------------
@pytest.mark.parametrize("methods,expected", [
    ("gac+gac", "method 'gac+gac': GAC twice; a run takes one callback of each type"),
    ("gac+gac-skip", "method 'gac+gac-skip': GAC twice"),
    ("m2po+bapo", "method 'm2po+bapo': at most one loss-side stabilizer per run, got M2PO, BAPO"),
    ("gac+m2po+tis", "at most one loss-side stabilizer per run, got M2PO, TIS"),
])
def test_a_combination_that_cannot_run_is_refused_before_anything_runs(tmp_path, capsys, methods, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        method_callbacks(methods)  # what a cell builds its callbacks with
    line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path)), "--tasks", "bandit", "--methods", methods)
    assert expected in line
    suite = tiny_suite(tmp_path, tasks={"bandit": {"objective": "bandit", "extra_methods": [methods]}})
    assert "extra_methods:" in refused(capsys, tmp_path, "--suite", str(suite))


def test_a_loss_side_stabilizer_on_an_objective_without_a_policy_loss_is_refused(tmp_path, capsys):
    line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path)), "--methods", "stale,gac+m2po")
    assert ("method 'gac+m2po' on task 'quadratic': M2PO is a loss-side stabilizer, and objective 'quadratic' "
            "computes its own loss") in line


# -- 3. method strings in canonical form --------------------------------------------------------------------------
@pytest.mark.parametrize("spec,canonical", [
    ("gac(c_low=0.1)", "gac(c_low=0.1)"),
    ("gac( c_low=0.1 )", "gac(c_low=0.1)"),
    ("gac (c_low=0.1)", "gac(c_low=0.1)"),
    ("gac()", "gac"),
    ("gac", "gac"),
    ("gac(c_low=0.05)", "gac"),  # GAC's default c_low
    ("gac(warmup=0)", "gac"),  # a method's GAC excludes no warm-up by default (the callback's own default is 50)
    ("gac(warmup=50)", "gac(warmup=50)"),
    ("gac(c_high=0.2,c_low=0.02)", "gac(c_low=0.02,c_high=0.2)"),  # the order of GAC's signature
    ("gac(c_low=0,c_high=0.3)", "gac(c_low=0.0)"),  # an integer for a number setting is that number
    ("gac-skip(high_mode='skip')", "gac-skip"),  # gac-skip's own default
    ("gac-skip(high_mode='project')", "gac-skip(high_mode='project')"),
    ("gac-calibrated(quantile=0.9,gap=0.3)", "gac-calibrated(gap=0.3)"),
    ('m2po(variant="areal")', "m2po(variant='areal')"),
    ("tis(cap=2)", "tis"),
    ("cispo(lower=0)", "cispo(lower=0)"),  # 0 is not False: kept, and refused when built
    ("gac( c_low=0.1 )+m2po(tau=0.04)", "gac(c_low=0.1)+m2po"),
    ("m2po+gac", "m2po+gac"),  # the parts keep their order (the order of the callbacks)
])
def test_method_specs_are_read_in_canonical_form(spec, canonical):
    assert canonical_method(spec) == canonical
    assert canonical_method(canonical) == canonical


def test_spellings_of_one_method_make_one_cell_and_count_as_a_repeat(tmp_path, capsys):
    suite = load_suite(str(tiny_suite(tmp_path)))
    methods = parse_methods("sync,gac( c_low=0.1 ),gac (c_high=0.3)", suite)
    assert methods == ["sync", "gac(c_low=0.1)", "gac"]
    cells = expand_cells(suite, methods=methods, tasks=["quadratic"])
    assert [c["method"] for c in cells] == ["sync", "gac(c_low=0.1)", "gac"]
    for spellings in ["gac(c_low=0.1),gac( c_low=0.1 )", "gac,gac()", "gac,gac(c_low=0.05)"]:
        first, second = spellings.split(",")
        line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path)), "--methods", spellings)
        assert f"lists {first!r} and {second!r}, which are one method, {canonical_method(first)}" in line
    line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path, methods=["sync", "gac", "gac()"])))
    assert "methods: lists 'gac' and 'gac()', which are one method, gac" in line


def test_a_setting_given_twice_is_refused_naming_it(tmp_path, capsys):
    line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path)), "--methods", "gac(c_low=0.1,c_low=0.2)")
    assert "method spec 'gac(c_low=0.1,c_low=0.2)': setting c_low is given twice; give it once" in line


def test_the_shipped_suites_keep_their_method_strings():
    """Stored grids stay reusable: every method a shipped suite lists is already canonical, and the threshold
    ablation keeps its explicit spelling (``gac(c_low=0.05,c_high=0.3)`` although both are GAC's defaults)."""
    for path in sorted(SUITES_DIR.glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())
        suite = load_suite(str(path))
        assert suite["methods"] == raw["methods"], path
        for task, spec in raw["tasks"].items():
            assert suite["tasks"][task].get("extra_methods") == spec.get("extra_methods"), (path, task)
            assert suite["tasks"][task].get("methods") == spec.get("methods"), (path, task)
        if raw.get("ablation"):
            a = raw["ablation"]
            cells = expand_cells(suite, methods=["ablation"], seeds=raw["seeds"][:1])
            explicit = [f"{a['method']}(c_low={lo},c_high={hi})" for lo in a["c_low"] for hi in a["c_high"] if lo < hi]
            with_ablation = [t for t in raw["tasks"].values() if "methods" not in t]  # own methods: no ablation
            assert sorted(c["method"] for c in cells) == sorted(explicit * len(with_ablation))
    defaults = [c for c in expand_cells(load_suite("synthetic"), methods=["ablation"], seeds=[0], tasks=["quadratic"])
                if c["method"] == "gac(c_low=0.05,c_high=0.3)"]
    assert len(defaults) == 1


# -- 4. a threshold that is not a finite literal --------------------------------------------------------------------
@pytest.mark.parametrize("spec,expected", [
    ("gac(c_low=nan)", "method spec 'gac(c_low=nan)': setting c_low=nan must be a finite number"),
    ("gac(c_high=inf)", "setting c_high=inf must be a finite number"),
    ("gac(c_low=1e999)", "setting c_low=1e999 must be a finite number"),
    ("gac(c_low=-inf)", "setting c_low=-inf must be a finite number"),
    ("gac(c_low=low)", "setting c_low=low is not a literal (settings are key=literal pairs: a number, True, False, "
                       "None or quoted text, e.g. c_low='low')"),
    ("gac(c_low=0.1)(c_high=0.2)", "settings are key=literal pairs separated by commas"),
])
def test_a_method_setting_that_is_not_a_finite_literal_is_named(tmp_path, capsys, spec, expected):
    with pytest.raises(ValueError) as exc:
        canonical_method(spec)
    assert expected in str(exc.value) and "ast." not in str(exc.value) and "Name" not in str(exc.value)
    assert expected in refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path)), "--methods", spec)


@pytest.mark.parametrize("over,expected", [
    ({"warmpu": 5}, "unknown key 'warmpu'; did you mean 'warmup'?"),
    ({"tasks": {"quadratic": {"objective": "quadratic", "parms": {"lr": 0.1}}}},
     "task 'quadratic': unknown key 'parms'; did you mean 'params'?"),
    ({"ablation": {"staleness": 4, "c_low": [-2], "c_high": [0.3]}}, "ablation: c_low: [-2] outside [0, 1]"),
    ({"ablation": {"staleness": 4, "c_low": [0.5], "c_high": [0.1, 0.3]}},
     "ablation: no pair of c_low [0.5] and c_high [0.1, 0.3] has c_low < c_high"),
    ({"ablation": {"staleness": 4, "c_low": [0.0], "c_high": [0.3], "methods": "gac"}},
     "ablation:: unknown key 'methods'; did you mean 'method'?"),
])
def test_a_misspelt_key_or_an_impossible_ablation_is_refused_before_anything_runs(tmp_path, capsys, over, expected):
    # a misspelt key would otherwise be ignored: the run would go on with the default in its place
    line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path, **over)))
    assert expected in line


@pytest.mark.parametrize("method,expected", [
    ("gac(c_lo=0.1)", "gac has no setting 'c_lo'; did you mean 'c_low'? its settings are c_low, c_high"),
    ("gac+m2po(tua=0.1)", "m2po has no setting 'tua'; did you mean 'tau'? its settings are tau"),
])
def test_a_misspelt_method_setting_names_the_closest_one(tmp_path, capsys, method, expected):
    line = refused(capsys, tmp_path, "--suite", str(tiny_suite(tmp_path)), "--methods", method)
    assert expected in line
