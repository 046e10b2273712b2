"""paper/trl_compare.py: the rounds, the ratios paired by round and the record, with a stand-in for TRL's side."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_PEER = '''import json, sys
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
assert Path(sys.argv[2], "config.json").exists() and Path(sys.argv[3]).read_text().count("\\n") == 320
calls = out.parent / "peer-calls"
n = len(calls.read_text().splitlines()) if calls.exists() else 0
calls.write_text("x\\n" * (n + 1))
(out / "times.json").write_text(json.dumps({"median_step_s_5_30": 0.5 * (n + 1), "median_generate_s_5_30": 0.1,
                                            "wall_s": 1.0}))
'''


def _module():
    spec = importlib.util.spec_from_file_location("trl_compare", REPO / "paper" / "trl_compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_each_round_runs_every_side_and_the_ratios_are_paired_by_round(tmp_path, capsys):
    pytest.importorskip("transformers")
    peer = tmp_path / "peer.py"
    peer.write_text(FAKE_PEER)
    out = tmp_path / "record.json"
    assert _module().main(["--peer", str(peer), "--trl-python", sys.executable, "--variants", "hf", "--rounds", "2",
                           "--out", str(tmp_path / "runs"), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())["table"]
    assert rec["trl"]["rounds"] == rec["hf"]["rounds"] == 2 and rec["trl"]["median_step_ms"] == pytest.approx(750)
    steps = [json.loads((tmp_path / "runs" / f"hf-r{r}.json").read_text())["median_step_s_5_30"] for r in (0, 1)]
    ratios = [steps[0] / 0.5, steps[1] / 1.0]  # each round's gacbench step over that round's TRL step
    assert rec["hf"]["ratio_min"] == pytest.approx(min(ratios)) and rec["hf"]["ratio_max"] == pytest.approx(max(ratios))
    assert len(json.loads((tmp_path / "runs" / "hf-r0.json").read_text())["step_s"]) == 30
    assert "| hf |" in capsys.readouterr().out


@pytest.mark.parametrize("args, words", [
    ([], "--peer None: give TRL's step script"),
    (["--peer", "/nonexistent.py"], "--peer '/nonexistent.py'"),
    (["--peer", __file__, "--variants", "hf,fast"], "--variants: fast not among hf, vllm, vllm-compile"),
])
def test_bad_options_are_refused_naming_the_fix(args, words, capsys):
    with pytest.raises(SystemExit) as exc:
        _module().main(args)
    assert exc.value.code == 2 and words in capsys.readouterr().err
