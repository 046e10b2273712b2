"""paper/overhead_series.py: the medians and ranges of a series of overhead records, and the refusal of runs
that are not one series, on hand records."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def series():
    spec = importlib.util.spec_from_file_location("overhead_series", REPO / "paper" / "overhead_series.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(shrink: float, keep: float, adamw: float, extra: float | None = 2.0, **over) -> dict:
    return {"params": 1000, "device": "cpu", "shape": None, "tensors": 3, "buffer_dtype": "float32", "repeats": 9,
            "kernels": ["eager", "compiled"], "threads": 2, "torch": "2.13.0+cpu", "adamw_step_eager_s": adamw,
            "gac_over_adamw": shrink, "gac_keep_over_adamw": keep, "gac_case": "shrink",
            "first_round_extra_compiled_s": extra, "gac_took_the_step": False,
            "provenance": {"code": {"commit": "a" * 40, "dirty": True}, "source_sha256": "1" * 64,
                           "packages": {"torch": "2.13.0+cpu"}}, **over}


def test_each_ratio_time_and_compile_is_summarised_by_its_median_and_range(series):
    runs = [run(1.2, 0.7, 0.010), run(0.9, 0.5, 0.014), run(1.0, 0.6, 0.012, extra=5.0), run(1.1, 0.4, 0.011)]
    rec = series.series_record(runs, ["gacbench", "overhead", "--params", "1000"])
    s = rec["summary"]
    assert s["gac_over_adamw"] == {"median": pytest.approx(1.05), "min": 0.9, "max": 1.2}
    assert s["gac_keep_over_adamw"] == {"median": pytest.approx(0.55), "min": 0.4, "max": 0.7}
    assert s["adamw_step_eager_s"] == {"median": pytest.approx(0.0115), "min": 0.010, "max": 0.014}
    assert s["first_round_extra_compiled_s"] == {"median": 2.0, "min": 2.0, "max": 5.0}
    assert set(s) == {"gac_over_adamw", "gac_keep_over_adamw", "adamw_step_eager_s", "first_round_extra_compiled_s"}
    assert rec["runs"] == runs and rec["runs_count"] == 4 and rec["params"] == 1000
    assert rec["command"] == "gacbench overhead --params 1000"
    # a figure that one run lacks (a path that fell back) is not summarised
    assert "first_round_extra_compiled_s" not in series.summarise([run(1, 1, 1), run(1, 1, 1, extra=None)])


def provenance(**over) -> dict:
    return {"provenance": {**run(1, 1, 1)["provenance"], **over}}


@pytest.mark.parametrize("over", [{"params": 2000}, {"threads": 1}, {"kernels": ["eager"]},
                                  provenance(code={"commit": "b" * 40, "dirty": True}),
                                  provenance(source_sha256="2" * 64),  # the same dirty checkout, edited
                                  provenance(packages={"torch": "2.11.0"})])
def test_runs_of_other_settings_or_code_are_not_one_series(series, over):
    with pytest.raises(SystemExit, match="not one series"):
        series.series_record([run(1, 1, 1), run(1, 1, 1, **over)], ["gacbench", "overhead"])


def test_the_script_runs_each_run_in_its_own_process_with_the_arguments_after_the_separator(series, tmp_path):
    out = tmp_path / "series.json"
    assert series.main(["--runs", "2", "--json", str(out), "--", "--params", "20000", "--repeats", "1",
                        "--kernels", "eager"]) == 0
    rec = json.loads(out.read_text())
    assert rec["runs_count"] == len(rec["runs"]) == 2 and rec["kernels"] == ["eager"] and rec["repeats"] == 1
    assert rec["params"] == rec["runs"][1]["params"] > 0
    assert rec["command"] == "gacbench overhead --params 20000 --repeats 1 --kernels eager"
    ratios = [r["gac_over_adamw"] for r in rec["runs"]]
    assert rec["summary"]["gac_over_adamw"] == {"median": pytest.approx(sum(ratios) / 2), "min": min(ratios),
                                                "max": max(ratios)}
    assert all(r["provenance"]["code"] == rec["runs"][0]["provenance"]["code"] for r in rec["runs"])
