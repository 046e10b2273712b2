"""paper/machine_effect.py: the same cells on two machine kinds compared on the final policy reward, the step where
the sampled training rewards part, and the move of each within-seed difference against the baseline, each equal to
a hand computation."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from gacbench.bench.cell import cell_dir, run_cell

REPO = Path(__file__).resolve().parents[1]
STEPS = 8


def _tool():
    spec = importlib.util.spec_from_file_location("machine_effect", REPO / "paper" / "machine_effect.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cell(store: Path, method: str, seed: int, final: float, rewards: list[float], version: int = STEPS) -> None:
    """A finished cell whose metrics.csv logs ``rewards`` by step and policy rewards at versions 4 and ``version``
    (the last: ``final``)."""
    cell = {"task": "q", "objective": "quadratic", "params": {"lr": 0.1}, "steps": STEPS, "method": method,
            "staleness": 2, "seed": seed}
    run_cell(cell, store)
    lines = ["step,reward/mean,eval/policy_reward,eval/policy_version"]
    lines += [f"{s},{r!r}," + ("0.5,4" if s == 4 else ",") for s, r in enumerate(rewards)]
    lines.append(f"{version},,{final!r},{version}")  # theta_version's reward, logged at step version
    (cell_dir(store, cell) / "metrics.csv").write_text("\n".join(lines) + "\n")


def test_differences_moves_and_parting_steps_match_a_hand_computation(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    rewards = [0.25, 0.5, 0.375, 0.5, 0.625, 0.5, 0.75, 0.625]
    finals = {("stale", 0): 0.20, ("stale", 1): 0.30, ("stale", 2): 0.25, ("gac", 0): 0.22, ("gac", 1): 0.35,
              ("gac", 2): 0.21}
    offsets = {("stale", 0): 0.01, ("stale", 1): -0.02, ("stale", 2): 0.0, ("gac", 0): 0.03, ("gac", 1): 0.01,
               ("gac", 2): -0.01}
    for (method, seed), final in finals.items():
        _cell(a, method, seed, final, rewards)
        parted = rewards[:5] + [0.875, 0.75, 0.5] if (method, seed) == ("gac", 1) else rewards
        _cell(b, method, seed, final + offsets[(method, seed)], parted)
    tool = _tool()
    res = tool.compare(tool.done_cells(a), tool.done_cells(b))
    diffs = np.array([offsets[(c["method"], c["seed"])] for c in res["cells"]])
    assert [round(c["diff"], 12) for c in res["cells"]] == [round(d, 12) for d in diffs]
    assert res["diff"]["diff"] == pytest.approx(diffs.mean())
    assert res["mean_abs_diff"] == pytest.approx(np.abs(diffs).mean())
    assert res["parted"] == 1 and [c["parts_at"] for c in res["cells"] if c["parts_at"] is not None] == [5]
    moves = {m["seed"]: m["move"] for m in res["moves"]}
    assert moves == pytest.approx({s: offsets[("gac", s)] - offsets[("stale", s)] for s in (0, 1, 2)})
    hand = np.array([0.02, 0.03, -0.01])
    half = 4.302652729911275 * hand.std(ddof=1) / np.sqrt(3)  # t_{0.975, 2}
    assert (res["move"]["ci_low"], res["move"]["ci_high"]) == pytest.approx((hand.mean() - half, hand.mean() + half))
    assert tool.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "training rewards part in 1 of 6 cells" in out and "largest +0.0300 (gac s = 2 seed 1)" in out


def test_cells_that_are_not_the_same_are_refused(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    rewards = [0.5] * STEPS
    _cell(a, "stale", 0, 0.2, rewards)
    _cell(b, "stale", 0, 0.2, rewards, version=STEPS - 2)
    _cell(c, "stale", 1, 0.2, rewards)
    tool = _tool()
    with pytest.raises(ValueError, match="policy version differs"):
        tool.compare(tool.done_cells(a), tool.done_cells(b))
    with pytest.raises(SystemExit):
        tool.main([str(a), str(c)])
