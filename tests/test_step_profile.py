"""gacbench step-profile: every phase of a GRPO step timed, the totals and shares consistent, strict JSON, and bad
options refused in one line."""

import json

import pytest

from gacbench.cli import main


def test_step_profile_times_every_phase_of_a_grpo_step(tiny_llm_dir, tmp_path, capsys):
    pytest.importorskip("transformers")
    from gacbench.llm.step_profile import PHASES

    out = tmp_path / "profile.json"
    assert main(["step-profile", "--engine", "hf", "--model", tiny_llm_dir, "--prompts", "3", "--group", "4",
                 "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    rec = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert set(rec["phases_s"]) == set(PHASES) and all(v >= 0 for v in rec["phases_s"].values())
    for key in PHASES:  # the medians are of the stored repeats
        assert len(rec["all_s"][key]) == 2
        assert rec["phases_s"][key] == pytest.approx(sum(rec["all_s"][key]) / 2)
    assert rec["stale_step_s"] == pytest.approx(sum(rec["phases_s"].values()))
    assert rec["sync_step_s"] == pytest.approx(rec["stale_step_s"] - rec["phases_s"]["behaviour"])
    assert sum(rec["share"].values()) == pytest.approx(1.0)
    # the thread count used; 1 as asked unless a vLLM engine built earlier in this process fixed it
    import torch

    assert rec["threads"] == torch.get_num_threads() and rec["prompts"] == 3 and rec["group"] == 4 and rec["params"] > 0
    assert 0 < rec["tokens_per_response"] <= 6
    assert "step-profile: weight_sync" in capsys.readouterr().err


@pytest.mark.parametrize("args, words", [
    (["--repeats", "0"], "--repeats 0"),
    (["--threads", "0"], "--threads 0"),
    (["--size", "huge"], "--size 'huge'"),
    (["--task", "nope"], "--task 'nope'"),
    (["--model", "/nonexistent"], "no config.json"),
])
def test_step_profile_refuses_bad_options_in_one_line(args, words, capsys):
    assert main(["step-profile", "--engine", "hf", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1

