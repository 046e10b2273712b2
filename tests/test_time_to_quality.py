"""The pipeline model of asynchronous rollouts (gacbench.bench.pipeline) against its closed forms and schedules
computed by hand, and ``gacbench time-to-quality`` on a grid and an async-bench record written by hand."""

import itertools
import json

import pytest

from gacbench.bench.cell import cell_dir
from gacbench.bench.groups import seed_mean, smooth_curve
from gacbench.bench.pipeline import (
    batch_latency,
    hiding_staleness,
    mean_step_s,
    simulate,
    steady_step_s,
)
from gacbench.bench.time_to_quality import async_bench_check, first_crossing
from gacbench.cli import main
from gacbench.jsonio import write_json

# -- the schedule by hand ---------------------------------------------------------------------------------------


def test_a_bounded_schedule_computed_by_hand():
    # G = 2, T = 1, one worker, s = 1. Step 0: generate 0-2, train 2-3 (version 1 at 3). Step 1 may start from
    # version 0: generate 2-4 (version 0 held at 2: lag 1), train 4-5. Step 2 needs version 1 (at 3): the worker is
    # free at 4, generates 4-6 with version 1 (lag 1), trains 6-7. Step 3 needs version 2 (at 5): generates 6-8
    # with version 2, trains 8-9.
    sched = simulate(2.0, 1.0, 1, 1, 4)
    assert sched.gen_start == [0, 2, 4, 6] and sched.gen_end == [2, 4, 6, 8]
    assert sched.train_start == [2, 4, 6, 8] and sched.train_end == [3, 5, 7, 9]
    assert sched.lag == [0, 1, 1, 1] and sched.makespan == 9
    assert [sched.version_time(v) for v in (0, 1, 1.5, 4)] == [0, 3, 4, 9]
    with pytest.raises(ValueError, match="outside 0..4"):
        sched.version_time(5)


def test_a_trainer_bound_schedule_by_hand_runs_s_versions_ahead():
    # G = 1, T = 2, s = 2: the worker generates steps 0, 1, 2 back to back from version 0 (lags 0, 1, 2); step 3
    # waits for version 1 (at 3) and is generated 3-4 with it (lag 2); the trainer runs back to back from 1.
    sched = simulate(1.0, 2.0, 1, 2, 4)
    assert sched.gen_start == [0, 1, 2, 3] and sched.train_end == [3, 5, 7, 9]
    assert sched.lag == [0, 1, 2, 2]


def test_jobs_go_to_the_first_free_worker_by_hand():
    # G = 4, T = 1, two workers, one job per step, s = 1: steps 0 and 1 generate side by side 0-4 (step 1 with
    # version 0: lag 1); step 1 trains after step 0 (4-5, 5-6); step 2 needs version 1 (at 5), both workers are
    # free: 5-9 with version 1 (lag 1), train 9-10
    sched = simulate(4.0, 1.0, 2, 1, 3, chunks=1)
    assert sched.gen_start == [0, 0, 5] and sched.train_end == [5, 6, 10] and sched.lag == [0, 1, 1]
    # the same batch split in two jobs: each step's two halves run side by side (2 s), synchronously 3 s a step
    split = simulate(4.0, 1.0, 2, 0, 2, chunks=2)
    assert split.gen_end == [2, 5] and split.train_end == [3, 6]


def _reference_schedule(gen_s, train_s, workers, staleness, steps, chunks):
    """The model's rule read literally: each job on the first free worker (the lowest index on a tie), scanning
    every worker."""
    free, t1 = [0.0] * workers, []
    out = {"gen_start": [], "gen_end": [], "train_start": [], "train_end": t1}
    for t in range(steps):
        admit = 0.0 if t - staleness <= 0 else t1[t - staleness - 1]
        starts, ends = [], []
        for _ in range(chunks):
            w = min(range(workers), key=lambda i: (free[i], i))
            starts.append(max(admit, free[w]))
            free[w] = starts[-1] + gen_s / chunks
            ends.append(free[w])
        begin = max(max(ends), t1[-1] if t1 else 0.0)
        out["gen_start"].append(min(starts)), out["gen_end"].append(max(ends)), out["train_start"].append(begin)
        t1.append(begin + train_s)
    return out


def test_the_remembered_steady_step_still_refuses_what_it_cannot_take():
    assert mean_step_s(1.0, 2.0, 1, 0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="workers"):
        mean_step_s(1.0, 2.0, True, 0)  # equal to 1 as a key: the cache must not answer for it


def test_the_schedule_is_the_rule_read_literally_on_random_settings():
    """simulate keeps the free workers in a heap: the same jobs on the same workers, bit for bit."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        g, t = rng.choice([0.0, rng.uniform(0, 5)]), rng.uniform(0.01, 5)
        n, s, steps, c = rng.randint(1, 9), rng.randint(0, 6), rng.randint(0, 40), rng.randint(1, 12)
        sched = simulate(g, t, n, s, steps, chunks=c)
        want = _reference_schedule(g, t, n, s, steps, c)
        assert {k: getattr(sched, k) for k in want} == want, (g, t, n, s, steps, c)


# -- the closed forms and limiting cases ------------------------------------------------------------------------
SETTINGS = [(g, t, n, c) for g, t, n, c in itertools.product((0.5, 1.0, 3.0), (0.25, 1.0, 2.0), (1, 2, 3, 4),
                                                             (1, None, "2n"))]


def _chunks(n, c):
    return 2 * n if c == "2n" else c


@pytest.mark.parametrize("s", [0, 1, 2, 5])
def test_the_simulated_steady_step_is_the_closed_form(s):
    for g, t, n, c in SETTINGS:
        c = _chunks(n, c)
        closed = steady_step_s(g, t, n, s, c)
        L = batch_latency(g, n, c)
        assert closed == pytest.approx(max(t, g / n, (L + t) / (s + 1)))
        assert mean_step_s(g, t, n, s, c, cycles=4) == pytest.approx(closed, rel=1e-9), (g, t, n, c, s)


def test_synchronous_steps_cost_generation_plus_training():
    for g, t, n, c in SETTINGS:
        c = _chunks(n, c)
        sched = simulate(g, t, n, 0, 6, c)
        step = batch_latency(g, n, c) + t  # G + T for one job per step, G / n + T for a batch split over n workers
        assert sched.train_end == pytest.approx([step * (k + 1) for k in range(6)])
        assert sched.lag == [0] * 6
    assert batch_latency(3.0, 3, 1) == 3.0 and batch_latency(3.0, 3, 3) == 1.0 and batch_latency(3.0, 2, 3) == 2.0


def test_one_worker_and_a_bound_at_least_the_run_generates_back_to_back():
    # n = 1 and s >= steps: nothing waits for a version, so batch k is ready at (k + 1) G and the trainer's step k
    # ends at max(its previous end, (k + 1) G) + T: G + T + (N - 1) max(G, T) for the whole run
    for g, t in itertools.product((0.5, 1.0, 3.0), (0.25, 1.0, 2.0)):
        sched = simulate(g, t, 1, 50, 20)
        assert sched.makespan == pytest.approx(g + t + 19 * max(g, t))
        assert steady_step_s(g, t, 1, 50) == max(g, t)


def test_cheap_generation_leaves_the_trainer_and_cheap_training_the_workers():
    # G << T: every s >= 1 steps at T; T << G: at G / n once s hides the batch's latency
    for n in (1, 2, 4):
        for s in (1, 3, 8):
            assert mean_step_s(0.01, 1.0, n, s, cycles=4) == pytest.approx(1.0)
        assert mean_step_s(4.0, 0.01, n, 0, cycles=4) == pytest.approx(4.0 / n + 0.01)
        assert mean_step_s(4.0, 0.01, n, 1, cycles=4) == pytest.approx(4.0 / n)


def test_step_time_never_grows_with_s_or_with_workers():
    for g, t in itertools.product((0.5, 1.0, 3.0), (0.25, 1.0, 2.0)):
        for c in (1, None):
            by = {(n, s): simulate(g, t, n, s, 30, c) for n in (1, 2, 3, 4) for s in range(7)}
            for n, s in by:
                step = mean_step_s(g, t, n, s, c, cycles=4)
                if s + 1 < 7:
                    assert mean_step_s(g, t, n, s + 1, c, cycles=4) <= step + 1e-12
                    assert by[(n, s + 1)].makespan <= by[(n, s)].makespan + 1e-12
                if n + 1 <= 4:
                    assert mean_step_s(g, t, n + 1, s, c, cycles=4) <= step + 1e-12
                    assert by[(n + 1, s)].makespan <= by[(n, s)].makespan + 1e-12
                assert all(0 <= x <= s for x in by[(n, s)].lag)


def test_the_staleness_that_hides_the_pipeline():
    # G = 2, T = 1, n = 1: (2 + 1) / 2 - 1 = 0.5 -> s = 1 reaches the bound 2; one job on four workers with G = 4:
    # (4 + 1) / 1 - 1 = 4
    assert hiding_staleness(2.0, 1.0, 1) == 1 and steady_step_s(2.0, 1.0, 1, 1) == 2.0
    assert hiding_staleness(4.0, 1.0, 4, 1) == 4
    assert steady_step_s(4.0, 1.0, 4, 3, 1) > 1.0 == steady_step_s(4.0, 1.0, 4, 4, 1)
    assert steady_step_s(3.0, 1.0, 2, 1, chunks=3) is None and hiding_staleness(3.0, 1.0, 2, 3) is None


@pytest.mark.parametrize("args, match", [((-1.0, 1.0, 1, 0, 3), "gen_s"), ((1.0, float("nan"), 1, 0, 3), "train_s"),
                                         ((1.0, 1.0, 0, 0, 3), "workers"), ((1.0, 1.0, 1, -1, 3), "staleness"),
                                         ((0.0, 0.0, 1, 0, 3), "both 0")])
def test_the_model_refuses_settings_it_cannot_take(args, match):
    with pytest.raises(ValueError, match=match):
        simulate(*args)


# -- curves and targets -----------------------------------------------------------------------------------------
def test_the_first_crossing_interpolates_linearly():
    curve = {0: 0.1, 10: 0.3, 20: 0.5, 30: 0.45}
    assert first_crossing(curve, 0.4) == (15.0, False)  # halfway from 0.3 to 0.5
    assert first_crossing(curve, 0.05) == (0, True)  # the first point already reaches it
    assert first_crossing(curve, 0.6) == (None, False)
    assert first_crossing(curve, 0.5) == (20.0, False)


def test_smoothing_and_the_seed_mean():
    assert smooth_curve({0: 1.0, 1: 2.0, 2: 3.0, 3: 5.0}, 2) == {0.5: 1.5, 1.5: 2.5, 2.5: 4.0}
    assert smooth_curve({0: 1.0, 1: 3.0}, 5) == {0.5: 2.0}
    assert seed_mean({0: {0: 1.0, 4: 2.0}, 1: {0: 3.0, 4: 4.0, 8: 9.0}}) == {0: 2.0, 4: 3.0}


# -- the command on a grid written by hand ----------------------------------------------------------------------
STEPS = 8


def _store(root, method, s, seed, policy):
    """A done rollout cell of STEPS steps: training reward 0.1 at every step (lag min(t, s)) and the policy reward
    ``policy`` ({version: value}) logged at those steps."""
    cell = {"task": "toy", "objective": "bandit", "params": {}, "steps": STEPS, "warmup": 0, "method": method,
            "staleness": s, "seed": seed}
    d = cell_dir(root, cell)
    d.mkdir(parents=True)
    write_json(d / "config.json", cell)
    rows = "".join(f"{t},0.1,{min(t, s)},\n" for t in range(STEPS))
    rows += "".join(f"{v},,,{x}\n" for v, x in policy.items())
    (d / "metrics.csv").write_text("step,reward/mean,stale/lag,eval/policy_reward\n" + rows)
    write_json(d / "status.json", {"status": "done", "initial": 0.0, "final": 0.0, "diverged": False,
                                   "metric": "reward", "higher_is_better": True, "steps_run": STEPS, "cell": cell})


@pytest.fixture
def grid(tmp_path):
    # sync: seed means 0.3 at version 4 and 0.5 at version 8 (the final: the 100% target; 90% = 0.45 is crossed at
    # version 4 + 0.15 / 0.2 x 4 = 7); stale at s = 2 reaches 0.5 at its first point (version 4); gac never reaches
    # 0.45; m2po at s = 2 has sync's mean curve
    root = tmp_path / "grid"
    for seed, (a, b) in enumerate([(0.2, 0.4), (0.4, 0.6)]):
        _store(root, "sync", 0, seed, {4: a, 8: b})
        _store(root, "stale", 2, seed, {4: 0.5, 8: 0.6})
        _store(root, "gac", 2, seed, {4: 0.1, 8: 0.2 + 0.3 * seed})
        _store(root, "m2po", 2, seed, {4: 0.3, 8: 0.5})
    return root


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_time_to_quality_on_a_grid_by_hand(grid, capsys):
    out = _json(capsys, ["time-to-quality", str(grid), "--setting", "2,1,1", "--json"])
    rows = {(r["method"], r["staleness"]): r for r in out["rows"]}
    assert "leaves out" in out["assumptions"]
    sync, stale, gac, m2po = rows[("sync", 0)], rows[("stale", 2)], rows[("gac", 2)], rows[("m2po", 2)]
    assert sync["measure"] == "eval/policy_reward" and sync["sync_final_reward"] == pytest.approx(0.5)
    # synchronous: a step is G + T = 3 s, so version v exists at 3 v: 100% at version 8 (24 s), 90% at 7 (21 s)
    assert sync["step_s"] == 3.0 and sync["last_version_s"] == 24.0
    (full, ninety) = sync["targets"]
    assert full["reward"] == pytest.approx(0.5) and full["time_s"] == pytest.approx(24.0)
    assert ninety["reward"] == pytest.approx(0.45) and ninety["version"] == pytest.approx(7.0)
    assert ninety["time_s"] == pytest.approx(21.0)
    # per seed against 0.45: seed 0 never (0.4 at the end), seed 1 at version 4 + 0.05 / 0.2 x 4 = 5 (15 s)
    assert ninety["seeds_reached"] == 1 and ninety["seed_time_min"] == pytest.approx(15.0)
    # s = 2: versions 1, 2, 3, 4 at 3, 5, 7, 9 s (max(T, G, (G + T) / 3) = 2 s a step after the first); the curve's
    # first point (version 4) already reaches 0.5: at most 9 s (an upper bound: no speed-up is claimed)
    assert stale["step_s"] == 2.0 and stale["throughput_vs_sync"] == pytest.approx(1.5)
    assert stale["targets"][0]["time_s"] == pytest.approx(9.0) and stale["targets"][0]["at_first_point"]
    assert stale["targets"][0]["speedup_vs_sync"] is None
    # sync's curve at s = 2: version 8 at 2 x 7 + 3 = 17 s, version 7 at 15 s
    assert [t["time_s"] for t in m2po["targets"]] == pytest.approx([17.0, 15.0])
    assert [t["speedup_vs_sync"] for t in m2po["targets"]] == pytest.approx([24 / 17, 21 / 15])
    assert gac["targets"][1]["time_s"] is None and gac["targets"][1]["seeds_reached"] == 1
    # the same setting through --gen/--train/--workers, and the text table
    assert main(["time-to-quality", str(grid), "--gen", "2", "--train", "1", "--workers", "1", "--methods", "gac"]) == 0
    text = capsys.readouterr().out
    assert "G=2 s, T=1 s, n=1, c=1" in text and "never" in text and "stale" not in text.split("setting")[1]
    assert main(["time-to-quality", str(grid), "--setting", "2,1,1", "--methods", "stale"]) == 0
    assert "<=9.0 s [2/2 9-9 s]" in capsys.readouterr().out


def test_the_training_reward_is_the_measure_without_policy_rewards(grid, capsys):
    out = _json(capsys, ["time-to-quality", str(grid), "--setting", "1,1,2", "--measure", "training", "--smooth",
                         "1", "--json"])
    sync = next(r for r in out["rows"] if r["method"] == "sync")
    # a flat training reward of 0.1 reaches its own final at version 0
    assert sync["measure"] == "reward/mean" and sync["targets"][0]["time_s"] == 0.0
    assert sync["setting"] == {"gen_s": 1.0, "train_s": 1.0, "workers": 2, "chunks": 2}


def _record(tmp_path):
    # 4 steps at s = 1, one worker; the sync run: G = 8 / 4 = 2, T = 4 / 4 = 1 per step; the async run: G' = (7.6 +
    # 0.4) / 4 = 2, T' = (10 - 1) / 4 = 2.25
    record = {"steps": 4, "max_staleness": 1, "settings": {"workers": 1, "task": "arithmetic", "prompts": 8,
                                                            "group": 8, "max_tokens": 6},
              "sync_generate_s": 8.0, "sync_train_s": 4.0, "sync_s": 12.0, "async_s": 10.0, "lag_mean": 0.75,
              "ideal_speedup": 1.5, "admission": "wait", "dropped": 0,
              "runs": {"async": {"async": {"worker_gen_s": 7.6, "worker_load_s": 0.4, "trainer_wait_s": 1.0}}}}
    path = tmp_path / "bench.json"
    write_json(path, record)
    return record, path


def test_the_check_against_async_bench_by_hand(tmp_path, capsys):
    record, path = _record(tmp_path)
    check = async_bench_check(record)
    # from the sync split (G = 2, T = 1): the first hand schedule, 9 s, lags 0, 1, 1, 1
    assert check["from_sync"]["async_s"] == pytest.approx(9.0) and check["from_sync"]["sync_s"] == pytest.approx(12)
    assert check["from_sync"]["speedup"] == pytest.approx(12 / 9) and check["from_sync"]["lag_mean"] == 0.75
    assert check["from_sync"]["steady_speedup"] == pytest.approx(1.5)
    # from the async parts (G' = 2, T' = 2.25): trains 2-4.25, 4.25-6.5, 6.5-8.75, 8.75-11 (step 2 waits for
    # version 1 at 4.25, step 3 for version 2 at 6.5; every step's generation hides behind the trainer's)
    assert check["from_async"]["async_s"] == pytest.approx(11.0)
    assert check["from_async"]["speedup"] == pytest.approx(12 / 11)
    assert check["measured"]["speedup"] == pytest.approx(1.2)
    out = _json(capsys, ["time-to-quality", "--from-async-bench", str(path), "--json"])
    assert out["async_bench"][0]["from_async"]["async_s"] == pytest.approx(11.0) and "rows" not in out
    assert main(["time-to-quality", "--from-async-bench", str(path)]) == 0
    text = capsys.readouterr().out
    assert "speed-up" in text and "1.333" in text and "1.091" in text and "1.200" in text


def _error(capsys, argv):
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gacbench time-to-quality: error: ")
    return lines[0]


def test_bad_input_is_one_line_naming_the_fix(grid, tmp_path, capsys):
    d = str(grid)
    assert "--setting: gen_s (G) = -1.0 must be a finite number of seconds >= 0" in _error(
        capsys, ["time-to-quality", d, "--setting=-1,1,1"])
    assert "--gen/--train/--workers: train_s (T) = -2.0 must be" in _error(
        capsys, ["time-to-quality", d, "--gen", "1", "--train", "-2", "--workers", "1"])
    assert "workers (n) = 0 must be an integer >= 1" in _error(capsys, ["time-to-quality", d, "--setting", "2,1,0"])
    short = _error(capsys, ["time-to-quality", d, "--setting", "2,1"])
    assert "give G,T,n or G,T,n,c" in short and "e.g. --setting 2,1,4" in short and "{option}" not in short
    assert "n and c integers" in _error(capsys, ["time-to-quality", d, "--setting", "2,1,1.5"])
    line = _error(capsys, ["time-to-quality", d, "--setting", "2,1,1", "--methods", "nope"])
    assert "nope not in" in line and "methods there: gac, m2po, stale, sync" in line
    assert "give at least one setting" in _error(capsys, ["time-to-quality", d])
    assert "go together" in _error(capsys, ["time-to-quality", d, "--gen", "2"])
    assert "every fraction must be a number > 0" in _error(capsys, ["time-to-quality", d, "--setting", "2,1,1",
                                                                     "--targets", "1,-0.9"])
    assert "holds no benchmark cells" in _error(capsys, ["time-to-quality", str(tmp_path / "none"), "--setting",
                                                          "2,1,1"])
    assert "give a benchmark directory" in _error(capsys, ["time-to-quality"])
    missing = _error(capsys, ["time-to-quality", "--from-async-bench", str(tmp_path / "x.json")])
    assert "no such file" in missing and "async-bench --json" in missing
    write_json(tmp_path / "cut.json", {"complete": False, "command": "async-bench"})
    assert "not a finished async-bench record" in _error(capsys, ["time-to-quality", "--from-async-bench",
                                                                   str(tmp_path / "cut.json")])
    write_json(tmp_path / "other.json", {"steps": 3})
    assert "the record lacks" in _error(capsys, ["time-to-quality", "--from-async-bench", str(tmp_path / "other.json")])
    assert "cannot be read" in _error(capsys, ["time-to-quality", "--from-async-bench", str(tmp_path)])
    zero, _ = _record(tmp_path)
    zero = {**zero, "sync_generate_s": 0.0, "sync_train_s": 0.0}
    write_json(tmp_path / "zero.json", zero)
    line = _error(capsys, ["time-to-quality", "--from-async-bench", str(tmp_path / "zero.json")])
    assert "sync_generate_s, sync_train_s must be a positive time" in line


def test_a_grid_without_sync_cells_is_refused(tmp_path, capsys):
    root = tmp_path / "grid"
    _store(root, "stale", 2, 0, {4: 0.5, 8: 0.6})
    assert "no done sync cell" in _error(capsys, ["time-to-quality", str(root), "--setting", "2,1,1"])


def test_sync_seeds_that_end_apart_or_a_final_reward_that_is_not_positive_are_refused_in_one_line():
    """The targets are fractions of the last point of sync's seed-mean curve: a sync seed that stopped early would
    make that an early version's reward (and every target and speed-up move with it), and a fraction of a reward
    that is not positive names no quality. Both are refused, naming the cause; equal ends and a positive final
    give the table."""
    from gacbench.bench.time_to_quality import Setting, time_to_quality
    from gacbench.usage import UsageError

    full = {v: 0.1 + 0.2 * v / 160 for v in (40, 80, 120, 160)}
    stale = {("stale", 16): {0: {v: 0.1 + 0.15 * v / 160 for v in (40, 80, 120, 160)}}}

    def table(sync):
        return time_to_quality({"t": {"measure": "eval/policy_reward", "runs": {("sync", 0): sync, **stale}}},
                               [Setting(2.0, 1.0, 1)])

    rows = table({0: full, 1: full})
    assert rows[0]["sync_final_reward"] == pytest.approx(0.3) and rows[0]["targets"][0]["time_s"] is not None
    with pytest.raises(UsageError, match=r"sync's seeds on task 't' end at different versions \(seed 0 at 160, "
                                         r"seed 1 at 80\)"):
        table({0: full, 1: {v: full[v] for v in (40, 80)}})
    with pytest.raises(UsageError, match=r"sync's final reward on task 't' is -0.5: the targets are fractions"):
        table({0: {v: -0.5 for v in (40, 80)}})


def test_a_method_whose_seed_stopped_early_says_where_its_curve_ends(capsys):
    """A seed that stopped early ends the method's seed-mean curve at its last version: the row lists it and the
    table says that 'never' means not by that version."""
    from gacbench.bench.time_to_quality import Setting, print_table, time_to_quality

    full = {v: 0.1 + 0.2 * v / 160 for v in (40, 80, 120, 160)}
    slow = {v: 0.1 + 0.1 * v / 160 for v in (40, 80, 120, 160)}
    runs = {("sync", 0): {0: full, 1: full}, ("stale", 16): {0: slow, 1: {40: 0.12, 80: 0.14}},
            ("gac", 16): {0: slow, 1: slow}}
    rows = time_to_quality({"t": {"measure": "eval/policy_reward", "runs": runs}}, [Setting(2.0, 1.0, 1)])
    by = {r["method"]: r for r in rows}
    assert by["stale"]["stopped_seeds"] == {"1": 80} and by["stale"]["versions"] == [40, 80]
    assert by["gac"]["stopped_seeds"] == {} and by["sync"]["stopped_seeds"] == {}
    print_table(rows)
    out = capsys.readouterr().out
    assert ("t: stale s=16: seed 1 at version 80 stopped before its other seeds (a non-finite loss ends a run); its "
            "seed-mean curve ends at version 80, so 'never' means not by then") in out
    assert "gac s=16: seed" not in out


# no speed-up against a sync time that is only an upper bound
def test_no_speedup_where_sync_reaches_the_target_at_its_first_point():
    """sync {1: 0.95, 10: 1.0}: its final is 1.0 and it reaches 0.9 at its first point (version 1): its time there is
    an upper bound, so stale's time to 0.9 (version 1 + 0.4 / 0.5 x 9 = 8.2) gets no speed-up; the 100% target
    (both at version 10) gets one."""
    from gacbench.bench.time_to_quality import Setting, time_to_quality

    curves = {"t": {"measure": "eval/policy_reward",
                    "runs": {("sync", 0): {0: {1.0: 0.95, 10.0: 1.0}}, ("stale", 1): {0: {1.0: 0.5, 10.0: 1.0}}}}}
    rows = time_to_quality(curves, [Setting(1.0, 1.0, 1)], fractions=(1.0, 0.9))
    stale = next(r for r in rows if r["method"] == "stale")
    full, ninety = stale["targets"]
    assert ninety["version"] == pytest.approx(8.2) and not ninety["at_first_point"]
    assert ninety["speedup_vs_sync"] is None
    assert full["speedup_vs_sync"] is not None


# the per-seed time range
def test_the_seed_time_range_is_min_to_max():
    """G = T = 1, n = 1, s = 0: version v exists at 2 v. Target 0.9 of the final 1.0: seed 0 ({0: 0, 10: 1}) reaches it
    at version 9 (18 s), seed 1 ({0: 0, 5: 1, 10: 1}) at 4.5 (9 s)."""
    from gacbench.bench.time_to_quality import Setting, time_to_quality

    curves = {"t": {"measure": "eval/policy_reward",
                    "runs": {("sync", 0): {0: {0.0: 0.0, 10.0: 1.0}, 1: {0.0: 0.0, 5.0: 1.0, 10.0: 1.0}}}}}
    (row,) = time_to_quality(curves, [Setting(1.0, 1.0, 1)], fractions=(0.9,))
    t = row["targets"][0]
    assert t["seeds_reached"] == 2
    assert (t["seed_time_min"], t["seed_time_max"]) == (pytest.approx(9.0), pytest.approx(18.0))


# hiding_staleness' rounding tolerance
def test_hiding_staleness_where_the_ratio_rounds_up():
    """G = 0.2 in one job, T = 0.1, n = 2: L = 0.2, bound max(T, G / n) = 0.1, (L + T) / (s + 1) = 0.3 / (s + 1) <= 0.1
    from s = 2; in floats (0.2 + 0.1) / 0.1 = 3.0000000000000004, which a bare ceil makes 3."""
    from gacbench.bench.pipeline import hiding_staleness

    assert hiding_staleness(0.2, 0.1, 2, 1) == 2
