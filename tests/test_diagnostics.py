"""Off-policy diagnostics of GRPO's update: ESS fraction and chi^2 of w = pi_theta / pi_behav over tokens and
sequences, checked by hand on hand-made weights, and logged by a GRPO run into metrics.csv."""

import csv
import math

import pytest
import torch

from gacbench.rollout.diagnostics import chi2, diagnostics_by_lag, ess_fraction, importance_diagnostics


def test_token_and_sequence_statistics_by_hand():
    # two sequences; the third position of the second row is padding (its value must be ignored)
    w = torch.tensor([[1.0, 2.0, 0.5], [1.0, 4.0, 123.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = importance_diagnostics(w.log(), mask)
    # tokens: w = 1, 2, 0.5, 1, 4: sum 8.5, sum w^2 = 1 + 4 + 0.25 + 1 + 16 = 22.25, N = 5
    assert float(out["is/ess_frac"]) == pytest.approx(8.5 ** 2 / (5 * 22.25), rel=1e-12)
    assert float(out["is/chi2"]) == pytest.approx(22.25 / 5 - 1, rel=1e-12)
    # sequences: w_seq = 1 * 2 * 0.5 = 1 and 1 * 4 = 4: sum 5, sum w^2 = 17, N = 2
    assert float(out["is/ess_frac_seq"]) == pytest.approx(25 / 34, rel=1e-12)
    assert float(out["is/chi2_seq"]) == pytest.approx(17 / 2 - 1, rel=1e-12)


def test_on_policy_weights_give_full_ess_and_zero_chi2_and_one_weight_gives_one_over_n():
    zeros = torch.zeros(3, 4)
    out = importance_diagnostics(zeros, torch.ones(3, 4))
    assert {k: float(v) for k, v in out.items()} == {"is/ess_frac": 1.0, "is/chi2": 0.0, "is/ess_frac_seq": 1.0,
                                                     "is/chi2_seq": 0.0}
    log_w = torch.tensor([0.0, -800.0, -800.0, -800.0])  # one weight carries everything
    assert float(ess_fraction(log_w)) == pytest.approx(0.25)


def test_large_log_weights_do_not_overflow_the_ess():
    log_w = torch.tensor([1000.0, 1000.0 + math.log(2.0)], dtype=torch.float64)  # w = e^1000 * (1, 2)
    assert float(ess_fraction(log_w)) == pytest.approx(9 / (2 * 5), rel=1e-12)
    assert math.isinf(float(chi2(log_w)))
    # e^710 overflows float64 but mean(w^2) = e^710 / 100 does not
    log_w = torch.tensor([355.0] + [-1e4] * 99, dtype=torch.float64)
    assert float(chi2(log_w)) == pytest.approx(math.exp(710 - math.log(100)), rel=1e-12)


def test_empty_and_mismatched_inputs():
    assert math.isnan(float(ess_fraction(torch.zeros(0)))) and math.isnan(float(chi2(torch.zeros(0))))
    out = importance_diagnostics(torch.zeros(2, 3), torch.zeros(2, 3))
    assert all(math.isnan(float(v)) for v in out.values())
    with pytest.raises(ValueError, match="same shape"):
        importance_diagnostics(torch.zeros(2, 3), torch.ones(2, 4))


def test_by_lag_splits_the_batch_by_each_samples_lag():
    w = torch.tensor([[1.0, 2.0], [0.5, 9.0], [4.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    out = diagnostics_by_lag(w.log(), mask, torch.tensor([0, 2, 0]))
    assert set(out) == {"is/behav_current_kl/lag0", "is/ess_frac/lag0", "is/behav_current_kl/lag2",
                        "is/ess_frac/lag2"}
    # lag 0: rows 0 and 2, w = 1, 2, 4, 1; lag 2: row 1's only response token, w = 0.5
    assert float(out["is/behav_current_kl/lag0"]) == pytest.approx(-math.log(8.0) / 4, rel=1e-12)
    assert float(out["is/ess_frac/lag0"]) == pytest.approx(64 / (4 * 22), rel=1e-12)
    assert float(out["is/behav_current_kl/lag2"]) == pytest.approx(math.log(2.0), rel=1e-12)
    assert float(out["is/ess_frac/lag2"]) == 1.0
    with pytest.raises(ValueError, match="one lag per row"):
        diagnostics_by_lag(w.log(), mask, torch.tensor([0, 1]))


def test_a_uniform_lag_grpo_run_logs_the_diagnostics_of_its_lag(tiny_llm_dir):
    """rollout.mode uniform: one lag per step; that lag's bucket is the whole batch, so its KL is the batch's."""
    from conftest import TINY_TASK, make_trainer

    from gacbench.llm.grpo import GRPOModule

    m = GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, task=dict(TINY_TASK),
                   rollout={"prompts": 4, "group": 4, "max_tokens": 4, "mode": "uniform", "max_staleness": 2},
                   lr=3e-3, steps=6, eval_every=10**6)
    trainer = make_trainer([], max_steps=6)
    trainer.fit(m)
    series = trainer.logger.series
    lags = dict(series["stale/lag"])
    assert len(set(lags.values())) > 1
    total, fresh = dict(series["is/behav_current_kl"]), dict(series["is/engine_mismatch_kl"])
    assert 0.0 in lags.values()
    for step, lag in lags.items():
        by_lag = dict(series[f"is/behav_current_kl/lag{int(lag)}"])
        assert by_lag[step] == pytest.approx(total[step], rel=1e-6, abs=1e-9)
        if lag == 0:  # the lag-0 bucket is the engine mismatch alone
            assert by_lag[step] == pytest.approx(fresh[step], rel=1e-6, abs=1e-9)
        assert 0.0 < dict(series[f"is/ess_frac/lag{int(lag)}"])[step] <= 1.0
    for key in series:  # no bucket for a lag that step did not have
        if key.startswith("is/ess_frac/lag"):
            assert all(lags[step] == int(key.rsplit("lag", 1)[1]) for step, _ in series[key])


def test_a_stale_grpo_run_logs_the_diagnostics_in_metrics_csv(tiny_llm_dir, tmp_path):
    pytest.importorskip("transformers")
    from conftest import TINY_TASK, make_trainer
    from lightning.pytorch.loggers import CSVLogger

    from gacbench.llm.grpo import GRPOModule

    m = GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, task=dict(TINY_TASK),
                   rollout={"prompts": 4, "group": 4, "max_tokens": 4}, staleness=2, lr=3e-3, steps=5)
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    make_trainer([], max_steps=5, logger=logger).fit(m)
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("is/ess_frac")]
    assert len(rows) == 5
    ess = [float(r["is/ess_frac"]) for r in rows]
    chi = [float(r["is/chi2_seq"]) for r in rows]
    ess_seq = [float(r["is/ess_frac_seq"]) for r in rows]
    assert ess[0] == pytest.approx(1.0, abs=1e-9)  # step 0 trains on its own policy's batch: w = 1
    assert all(0.0 < e <= 1.0 for e in ess + ess_seq) and max(ess[1:]) < 1.0 - 1e-6  # lagged steps are off-policy
    assert all(c >= -1.0 for c in chi) and min(abs(c) for c in chi[1:]) > 0.0
