"""Loss-side baselines against hand computations, the stabilizer API's rules, the registry and its
entry-point group, and the documentation's example."""

import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_trainer

from gacbench.methods import method_callbacks
from gacbench.objectives import NoisyQuadratic, SoftmaxBandit
from gacbench.stabilizers import (
    BAPO, M2PO, TIS, DecoupledPPO, PolicyBatch, agg_loss, bapo_bounds, clipped_surrogate, m2po_mask, m2po_official_bounds,
)

ROOT = Path(__file__).resolve().parents[1]


def batch_of(logp, logp_behav, adv, mask=None):
    logp = torch.tensor(logp, dtype=torch.float64).reshape(1, -1).requires_grad_(True)
    lb = torch.tensor(logp_behav, dtype=torch.float64).reshape(1, -1)
    a = torch.tensor(adv, dtype=torch.float64).reshape(1, -1)
    m = torch.ones_like(a, dtype=torch.bool) if mask is None else torch.tensor(mask).reshape(1, -1)
    return PolicyBatch(logp, lb, a, m)


def test_m2po_mask_hand_example():
    log_ratio = torch.tensor([[0.1, 0.5, -0.3, 0.05, 2.0]])
    mask = torch.tensor([[True, True, True, True, False]])  # the padded token never counts
    # (log r)^2 = .01 .25 .09 .0025; mean .088 > .04: drop .25 -> mean .034 <= .04
    assert m2po_mask(log_ratio, mask, 0.04).tolist() == [[True, False, True, True, False]]
    # tau .02: drop .25 and .09 -> mean .00625
    assert m2po_mask(log_ratio, mask, 0.02).tolist() == [[True, False, False, True, False]]
    assert m2po_mask(log_ratio, mask, 1.0).tolist() == mask.tolist()  # within budget: nothing masked


def test_m2po_mask_drops_ties_at_the_cut_together():
    log_ratio = torch.tensor([[0.3, 0.3, 0.3, 0.05, 0.05]])  # dropping one 0.09 leaves (0.09 * 2 + ...)/4 > 0.04
    keep = m2po_mask(log_ratio, torch.ones_like(log_ratio, dtype=torch.bool), 0.04)
    assert keep.tolist() == [[False, False, False, True, True]]


def test_m2po_mask_property_kept_second_moment_within_budget():
    gen = torch.Generator().manual_seed(0)
    for i in range(80):
        lr = torch.randn(3, 17, generator=gen) * 0.4
        if i % 2:  # many ties, as when one (context, action) repeats within a bandit group
            lr = lr.round(decimals=1)
        mask = torch.rand(3, 17, generator=gen) > 0.2
        keep = m2po_mask(lr, mask, 0.04)
        assert not (keep & ~mask).any()
        if keep.any():
            assert float((lr[keep] ** 2).mean()) <= 0.04 + 1e-7
        dropped = mask & ~keep
        if dropped.any() and keep.any():  # only the largest values are dropped
            assert float((lr[dropped] ** 2).min()) >= float((lr[keep] ** 2).max())


def test_m2po_official_bounds_hand_example():
    lr = torch.tensor([[0.4, 0.1, -0.3, 0.2]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])  # harmful: tokens 0, 1, 2 (v = .16 .01 .09, mean .0867)
    lo, hi, m2 = m2po_official_bounds(lr, adv, torch.ones_like(adv, dtype=torch.bool), 0.04)
    assert m2 == pytest.approx((0.16 + 0.01 + 0.09) / 3)
    # capped means at the breakpoints .01 -> .01, .09 -> .0633: the cut is at t^2 = .01
    assert (lo, hi) == pytest.approx((math.exp(-0.1), math.exp(0.1)))
    assert m2po_official_bounds(lr, adv, torch.ones_like(adv, dtype=torch.bool), 1.0)[:2] == (0.0, math.inf)


def test_m2po_loss_is_minus_ratio_times_advantage_over_kept_tokens():
    b = batch_of([0.1, 0.5, -0.3, 0.05], [0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 1.0])
    loss, metrics = M2PO(tau=0.04).policy_loss(b)
    r = torch.exp(torch.tensor([0.1, 0.5, -0.3, 0.05], dtype=torch.float64))
    expected = -(r[0] * 1.0 + r[2] * 0.5 + r[3] * 1.0) / 4  # token 1 masked; token-mean over all 4
    assert loss.item() == pytest.approx(float(expected))
    assert float(metrics["m2po/masked_frac"]) == pytest.approx(0.25)


def test_bapo_bounds_hand_example():
    ratio = torch.tensor([[1.52, 2.5, 0.7, 1.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones_like(adv, dtype=torch.bool)
    # high-first: share is 0 until c_high reaches 1.55 (token 0 admitted): 1.52 / (1.52 + 1.7) >= 0.4
    assert bapo_bounds(ratio, adv, mask) == pytest.approx((0.6, 1.55))
    # low-first: c_low rises to 0.9 (token 2 excluded: neg = 1.0), then c_high to 1.55: 1.52 / 2.52
    assert bapo_bounds(ratio, adv, mask, order="low-first") == pytest.approx((0.9, 1.55))
    # unreachable target: both bounds end at their maxima
    assert bapo_bounds(ratio, adv, mask, rho0=0.99) == pytest.approx((0.9, 3.0))


def test_bapo_loss_uses_the_chosen_bounds():
    b = batch_of([math.log(1.52), math.log(2.5), math.log(0.7), 0.0], [0, 0, 0, 0], [1.0, 1.0, -1.0, -1.0])
    loss, metrics = BAPO().policy_loss(b)
    ref, _ = clipped_surrogate(b, ratio_low=0.6, ratio_high=1.55)
    assert loss.item() == pytest.approx(ref.item())
    assert metrics["bapo/c_high"] == pytest.approx(1.55) and metrics["bapo/pos_share"] >= 0.4


def test_clipped_surrogate_hand_computation():
    b = batch_of([math.log(1.5), math.log(0.5), 0.0], [0, 0, 0], [1.0, -1.0, 2.0])
    loss, metrics = clipped_surrogate(b, 0.2, 0.2)
    # token 0: min(1.5, 1.2) * 1 = 1.2; token 1: A<0, max(-0.5*-1... ) -> -min(r A, clip(r) A) = max(0.5, 0.8) = 0.8; token 2: 2
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3)
    assert float(metrics["pg/clipfrac"]) == pytest.approx(2 / 3)


def test_aggregation_modes_equal_loops():
    gen = torch.Generator().manual_seed(1)
    x, mask = torch.randn(4, 6, generator=gen), torch.rand(4, 6, generator=gen) > 0.3
    mask[:, 0] = True
    assert float(agg_loss(x, mask, "token-mean")) == pytest.approx(float(x[mask].mean()), rel=1e-6)
    seq = [float(x[i][mask[i]].mean()) for i in range(4)]
    assert float(agg_loss(x, mask, "seq-mean-token-mean")) == pytest.approx(sum(seq) / 4, rel=1e-6)
    seq = [float(x[i][mask[i]].sum()) for i in range(4)]
    assert float(agg_loss(x, mask, "seq-mean-token-sum")) == pytest.approx(sum(seq) / 4, rel=1e-6)


def test_tis_and_decoupled_ppo_hand_computation():
    b = batch_of([-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5], [1.0, -1.0, 2.0])
    w = torch.exp(torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64))  # pi_prox / pi_behav (prox = current)
    loss, m = DecoupledPPO().policy_loss(b)
    assert loss.item() == pytest.approx(float(-(w * torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)).mean()))
    loss.backward()
    # r = pi/pi_prox = 1 in value: the gradient is -(w A)/3 per token's logp
    assert b.logp.grad.reshape(-1).tolist() == pytest.approx((-(w * torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)) / 3).tolist())
    b2 = batch_of([-1.0, -2.0, -0.5], [-1.5, -1.0, -0.5], [1.0, -1.0, 2.0])
    loss_tis, mt = TIS(cap=1.2).policy_loss(b2)
    wt = w.clamp(max=1.2)
    assert loss_tis.item() == pytest.approx(float(-(wt * torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)).mean()))
    assert float(mt["is/truncated_frac"]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("kwargs,cls,match", [({"tau": 0}, M2PO, "tau"), ({"variant": "x"}, M2PO, "variant"),
                                              ({"rho0": 1.5}, BAPO, "rho0"), ({"a_low": 0.95}, BAPO, "a_low"),
                                              ({"cap": -1}, TIS, "cap"), ({"agg": "sum"}, M2PO, "agg")])
def test_bad_arguments_are_named(kwargs, cls, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_two_loss_side_stabilizers_are_refused():
    with pytest.raises(ValueError, match="at most one loss-side stabilizer"):
        make_trainer([M2PO(), BAPO()], max_steps=2).fit(SoftmaxBandit(steps=2))


def test_loss_side_stabilizer_on_a_module_without_a_policy_loss_is_refused():
    with pytest.raises(TypeError, match="computes its own loss"):
        make_trainer([M2PO()], max_steps=2).fit(NoisyQuadratic(steps=2))


@pytest.mark.parametrize("spec", ["m2po", "m2po(variant='official')", "bapo", "tis", "decoupled-ppo", "gac+m2po"])
def test_every_baseline_trains_the_bandit_from_stale_rollouts(spec):
    model = SoftmaxBandit(steps=60, staleness=8)
    start = model.metric()
    trainer = make_trainer(method_callbacks(spec), max_steps=60)
    trainer.fit(model)
    assert model.metric() > start
    assert trainer.logger.values("stale/lag")[-1] == 8
    key = {"m2po": "m2po/m2", "bapo": "bapo/c_high", "tis": "is/truncated_frac", "decoupled-ppo": "is/weight_mean"}
    name = spec.split("(")[0].split("+")[-1]
    assert len(trainer.logger.values(key.get(name, "is/ratio_mean"))) == 60


def _doc_example() -> str:
    text = (ROOT / "docs" / "add-a-stabilizer.md").read_text()
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def test_the_documented_example_runs_and_is_short():
    code = _doc_example()
    assert len(code.strip().splitlines()) < 40
    ns: dict = {}
    exec(compile(code, "add-a-stabilizer.md", "exec"), ns)
    model = SoftmaxBandit(steps=40, staleness=4)
    start = model.metric()
    trainer = make_trainer([ns["CISPO"](cap=2.0)], max_steps=40)
    trainer.fit(model)
    assert model.metric() > start and len(trainer.logger.values("cispo/truncated_frac")) == 40


def test_entry_point_plugin_is_listed_and_runs_in_bench(tmp_path):
    site = tmp_path / "site"
    (site / "myplugin").mkdir(parents=True)
    (site / "myplugin" / "__init__.py").write_text(_doc_example())
    dist = site / "myplugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[gacbench.stabilizers]\ncispo = myplugin:CISPO\n")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    listed = subprocess.run([sys.executable, "-m", "gacbench.cli", "stabilizers", "--json"], capture_output=True, text=True, env=env)
    assert listed.returncode == 0, listed.stderr
    names = {s["name"]: s for s in json.loads(listed.stdout)}
    assert {"gac", "m2po", "bapo", "tis", "decoupled-ppo", "cispo"} <= set(names)
    assert names["cispo"]["kind"] == "loss" and names["cispo"]["source"] == "myplugin:CISPO"
    suite = tmp_path / "s.yaml"
    suite.write_text(textwrap.dedent("""
        name: plugin
        steps: 30
        tasks: {bandit: {objective: bandit, params: {lr: 0.05}}}
        methods: [sync]
        staleness: [0, 4]
        seeds: [0]
    """))
    run = subprocess.run([sys.executable, "-m", "gacbench.cli", "bench", "--suite", str(suite), "--out", str(tmp_path / "out"),
                          "--methods", "cispo,gac+cispo", "--workers", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {c["method"] for c in summary["cells"] if c["status"] == "done"} == {"cispo", "gac+cispo"}
