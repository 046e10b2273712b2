"""The sequence-policy objective: its exact metric, and the staleness signature with and without its ingredients."""

import json

import pytest
import torch

from gacbench.bench.cell import cell_dir, run_cell
from gacbench.bench.report import read_metrics
from gacbench.functional.stats import alignment_summary
from gacbench.objectives import SequencePolicy, objective_class


def test_exact_metric_matches_sampling():
    m = SequencePolicy(contexts=32, length=3, vocab=5, seed=1)
    with torch.no_grad():
        m.W.normal_(0, 1.5, generator=torch.Generator().manual_seed(0))
        m.B.normal_(0, 1.5, generator=torch.Generator().manual_seed(1))
    data = m.rollout(torch.arange(32).repeat(200), version=0)  # 32 x 200 x 8 sampled sequences
    sampled = float(data["rewards"].mean())
    assert m.metric() == pytest.approx(sampled, abs=0.01)
    assert objective_class("sequence") is SequencePolicy


def test_unshared_variant_never_trains_the_transition_table(tmp_path):
    cell = {"task": "seq", "objective": "sequence", "params": {"shared_bias": False}, "steps": 20, "method": "stale",
            "staleness": 4, "seed": 0, "warmup": 0}
    assert run_cell(cell, tmp_path)["status"] == "done"
    m = SequencePolicy(shared_bias=False)
    assert not m.B.requires_grad and len(m.configure_optimizers().param_groups[0]["params"]) == 1


def _median_cos(tmp_path, params, method, s):
    cell = {"task": "seq", "objective": "sequence", "params": {"lr": 0.05, **params}, "steps": 300, "method": method,
            "staleness": s, "seed": 0, "warmup": 50}
    status = run_cell(cell, tmp_path / json.dumps(params, sort_keys=True).replace('"', ""))
    assert status["status"] == "done", status.get("error")
    cos = [v for _, v in read_metrics(cell_dir(tmp_path / json.dumps(params, sort_keys=True).replace('"', ""), cell)
                                      / "metrics.csv")["align/cos"]]
    return alignment_summary(cos, warmup=50)["median"]


def test_signature_needs_the_clip_and_shared_parameters(tmp_path):
    sync = _median_cos(tmp_path, {}, "sync", 0)
    assert abs(sync) < 0.1  # synchronous gradients are near-orthogonal
    assert _median_cos(tmp_path, {}, "stale", 32) - sync > 0.15  # the signature
    unclipped = {"clip_low": 0.999, "clip_high": 1000.0}
    assert _median_cos(tmp_path, unclipped, "stale", 32) - sync < 0.05  # unbiased importance weights: none
    unshared = {"shared_bias": False}
    assert _median_cos(tmp_path, unshared, "stale", 32) - _median_cos(tmp_path, unshared, "sync", 0) < 0.08
