"""The stabilizer API's rules (PolicyBatch, aggregation, the default surrogate, one loss-side stabilizer per
run), every registered method training the bandit from stale rollouts, the registry and its entry-point group,
and the documentation's example. Hand computations of each baseline: tests/test_baselines.py."""

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
    BAPO,
    CISPO,
    GSPO,
    M2PO,
    MIS,
    TIS,
    VCPO,
    DualClipPPO,
    IcePop,
    PolicyBatch,
    agg_loss,
    clipped_surrogate,
    registry,
)
from gacbench.stabilizers.registry import available

ROOT = Path(__file__).resolve().parents[1]


def batch_of(logp, logp_behav, adv, mask=None):
    logp = torch.tensor(logp, dtype=torch.float64).reshape(1, -1).requires_grad_(True)
    lb = torch.tensor(logp_behav, dtype=torch.float64).reshape(1, -1)
    a = torch.tensor(adv, dtype=torch.float64).reshape(1, -1)
    m = torch.ones_like(a, dtype=torch.bool) if mask is None else torch.tensor(mask).reshape(1, -1)
    return PolicyBatch(logp, lb, a, m)


def test_clipped_surrogate_hand_computation():
    b = batch_of([math.log(1.5), math.log(0.5), 0.0], [0, 0, 0], [1.0, -1.0, 2.0])
    loss, metrics = clipped_surrogate(b)  # the batch's default clip range [0.8, 1.2]
    # per-token loss -min(r A, clip(r) A): token 0: -min(1.5, 1.2) = -1.2; token 1 (A = -1): max(0.5, 0.8) = 0.8;
    # token 2: -2
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


def test_seq_mean_modes_leave_out_a_sequence_without_tokens_as_verl_does():
    """verl's agg_loss divides the seq-mean modes by the sequences holding a mask token (seq_mask = mask.sum(-1) > 0):
    a sequence rejected whole (MIS) leaves the count. Rows: 2 tokens (1, 3), none, 1 token (4)."""
    x = torch.tensor([[1.0, 3.0, 9.0], [5.0, 5.0, 5.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    assert float(agg_loss(x, mask, "seq-mean-token-mean")) == pytest.approx((2.0 + 4.0) / 2)
    assert float(agg_loss(x, mask, "seq-mean-token-sum")) == pytest.approx((4.0 + 4.0) / 2)
    assert float(agg_loss(x, mask, "token-mean")) == pytest.approx(8.0 / 3)
    # MIS at seq-mean: the rejected sequence is not averaged in as a zero
    logp = torch.zeros(2, 2, requires_grad=True)
    engine = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])  # row 0: rho = e^2 > 2, rejected
    batch = PolicyBatch(logp, logp.detach(), torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool),
                        agg="seq-mean-token-mean", logp_engine=engine)
    loss, _ = MIS().policy_loss(batch)
    assert loss.item() == pytest.approx(-1.0)  # row 1 alone: -mean(rho A r) = -1


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_an_empty_batch_gives_a_zero_loss_and_finite_metrics_for_every_loss_side_stabilizer(agg):
    # no sequences, or sequences whose mask has no response token: every loss 0 with a zero gradient, no metric nan
    for rows, tokens in [(0, 3), (2, 3)]:
        logp = torch.full((rows, tokens), -0.5, requires_grad=True)
        empty = PolicyBatch(logp, torch.full((rows, tokens), -1.0), torch.ones(rows, tokens),
                            torch.full((rows, tokens), rows == 0), logp_engine=torch.full((rows, tokens), -0.7),
                            group=torch.zeros(rows, dtype=torch.long), lag=torch.zeros(rows), agg=agg)
        losses = {"surrogate": clipped_surrogate(empty)}
        for name, entry in available().items():
            if entry["kind"] != "loss":
                continue
            stabilizer = entry["cls"]()
            stabilizer._params = [logp]  # what VCPO's setup records: the module's trainable parameters
            losses[name] = stabilizer.policy_loss(empty)
        assert len(losses) >= 15
        for name, (loss, metrics) in losses.items():
            assert float(loss.detach()) == 0.0, (name, rows, tokens)
            (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
            assert grad is None or not grad.any(), name
            bad = {k: v for k, v in metrics.items() if not torch.isfinite(torch.as_tensor(v, dtype=torch.float64))}
            assert not bad, (name, rows, tokens, bad)


@pytest.mark.parametrize("kwargs,cls,match", [({"tau": 0}, M2PO, "tau"), ({"variant": "x"}, M2PO, "variant"),
                                              ({"weight_cap": 2.0}, M2PO, "weight_cap"), ({"rho0": 1.5}, BAPO, "rho0"),
                                              ({"a_low": 0.95}, BAPO, "a_low"), ({"variant": "code"}, BAPO, "variant"),
                                              ({"cap": -1}, TIS, "cap"), ({"clip_c": 1.0}, DualClipPPO, "clip_c"),
                                              ({"clip_low": 1.5}, GSPO, "clip_low"), ({"lower": "yes"}, CISPO, "lower"),
                                              ({"level": "batch"}, MIS, "level"), ({"alpha": 2.0}, IcePop, "alpha"),
                                              ({"rho_base": 0}, VCPO, "rho_base")])
def test_bad_arguments_are_named(kwargs, cls, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_loss_settings_are_module_settings_not_stabilizer_arguments():
    with pytest.raises(ValueError, match="agg"):
        method_callbacks("m2po(agg='token-mean')")


@pytest.mark.parametrize("kwargs,match", [({"agg": "sum"}, "agg"), ({"clip_low": 1.0}, "clip_low"),
                                          ({"logp_engine": torch.zeros(2, 3)}, "shape"),
                                          ({"group": torch.zeros(3)}, "group")])
def test_policy_batch_names_bad_settings(kwargs, match):
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=match):
        PolicyBatch(x, x, x, x.bool(), **kwargs)


def test_two_loss_side_stabilizers_are_refused():
    with pytest.raises(ValueError, match="at most one loss-side stabilizer"):
        make_trainer([M2PO(), BAPO()], max_steps=2).fit(SoftmaxBandit(steps=2))


def test_loss_side_stabilizer_on_a_module_without_a_policy_loss_is_refused():
    with pytest.raises(TypeError, match="computes its own loss"):
        make_trainer([M2PO()], max_steps=2).fit(NoisyQuadratic(steps=2))


LOSS_SIDE = sorted(n for n, c in registry._builtins().items() if c.kind == "loss")  # not an installed plug-in's
KEY = {"m2po": "m2po/m2", "bapo": "bapo/c_high", "tis": "is/truncated_frac", "decoupled-ppo": "is/weight_mean",
       "dual-clip": "pg/clipfrac_dual", "gspo": "gspo/seq_ratio_mean", "cispo": "cispo/ratio_high",
       "tis-engine": "is/engine_truncated_frac", "mis": "mis/masked_frac", "icepop": "icepop/masked_frac",
       "vcpo": "vcpo/lr_scale", "m2po-threshold": "m2po/m2", "opsm": "opsm/masked_frac",
       "geo-seq-mask": "geo/masked_frac",
       "vespo": "vespo/phi_mean", "a3po": "a3po/alpha_mean"}


def test_every_loss_side_stabilizer_has_a_training_check():
    assert set(LOSS_SIDE) == set(KEY)


@pytest.mark.parametrize("spec", LOSS_SIDE + ["m2po(variant='areal')", "m2po(variant='official')",
                                              "bapo(variant='official')", "mis(level='token')", "gac+m2po"])
def test_every_baseline_trains_the_bandit_from_stale_rollouts(spec):
    model = SoftmaxBandit(steps=60, staleness=8)
    start = model.metric()
    trainer = make_trainer(method_callbacks(spec), max_steps=60)
    trainer.fit(model)
    assert model.metric() > start + 0.05
    assert trainer.logger.values("stale/lag")[-1] == 8
    name = spec.split("(")[0].split("+")[-1]
    assert len(trainer.logger.values(KEY[name])) == 60


def test_vcpo_lowers_the_step_when_the_effective_sample_size_drops():
    model = SoftmaxBandit(steps=40, staleness=16)
    trainer = make_trainer(method_callbacks("vcpo"), max_steps=40)
    trainer.fit(model)
    scales = trainer.logger.values("vcpo/lr_scale")
    assert scales[0] == pytest.approx(1.0) and min(scales) < 1.0  # stale weights spread once the policy moves
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(model.hparams.lr)  # restored after each step


def _doc_example(which: int = 0) -> str:
    """The ``which``-th python code block of docs/add-a-stabilizer.md."""
    text = (ROOT / "docs" / "add-a-stabilizer.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)[which]


def test_the_documented_gradient_side_example_damps_aligned_steps_and_resumes_exactly(tmp_path):
    """The second example: a gradient-side callback that scales each gradient by 1 / (1 + alpha max(0, c_t)).
    Its logged scale is in (0, 1] after the first step, and a run checkpointed at step 10 and resumed ends with
    the uninterrupted run's parameters (its previous gradient is in the checkpoint)."""
    ns: dict = {}
    exec(compile(_doc_example(1), "add-a-stabilizer.md", "exec"), ns)
    with pytest.raises(ValueError, match="alpha=-1"):
        ns["CosDamp"](alpha=-1)
    model = SoftmaxBandit(steps=20, staleness=4)
    trainer = make_trainer([ns["CosDamp"](alpha=2.0)], max_steps=20)
    trainer.fit(model)
    scales = trainer.logger.values("cosdamp/scale")
    assert len(scales) == 19 and all(0 < x <= 1 for x in scales) and min(scales) < 1
    first = SoftmaxBandit(steps=20, staleness=4)
    t1 = make_trainer([ns["CosDamp"](alpha=2.0)], max_steps=10)
    t1.fit(first)
    t1.save_checkpoint(tmp_path / "ten.ckpt")
    resumed = SoftmaxBandit(steps=20, staleness=4)
    t2 = make_trainer([ns["CosDamp"](alpha=2.0)], max_steps=20)
    t2.fit(resumed, ckpt_path=tmp_path / "ten.ckpt")
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_the_documented_example_runs_and_is_short():
    code = _doc_example()
    assert len(code.strip().splitlines()) < 40
    ns: dict = {}
    exec(compile(code, "add-a-stabilizer.md", "exec"), ns)
    model = SoftmaxBandit(steps=40, staleness=4)
    start = model.metric()
    trainer = make_trainer([ns["GeoMask"](low=0.5, high=2.0)], max_steps=40)
    trainer.fit(model)
    assert model.metric() > start and len(trainer.logger.values("geo/masked_frac")) == 40


def test_entry_point_plugin_is_listed_and_runs_in_bench(tmp_path):
    site = tmp_path / "site"
    (site / "myplugin").mkdir(parents=True)
    (site / "myplugin" / "__init__.py").write_text(_doc_example())
    dist = site / "myplugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[gacbench.stabilizers]\ngeo-mask = myplugin:GeoMask\n")
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    listed = subprocess.run([sys.executable, "-m", "gacbench.cli", "stabilizers", "--json"], capture_output=True,
                            text=True, env=env)
    assert listed.returncode == 0, listed.stderr
    names = {s["name"]: s for s in json.loads(listed.stdout)}
    assert set(available()) <= set(names) and len(names) >= 15  # 14 built-ins + the plugin
    assert {"gac", "m2po", "bapo", "tis", "decoupled-ppo", "dual-clip", "gspo", "cispo", "tis-engine", "mis", "icepop",
            "vcpo"} <= set(names)
    assert names["geo-mask"]["kind"] == "loss" and names["geo-mask"]["source"] == "myplugin:GeoMask"
    suite = tmp_path / "s.yaml"
    suite.write_text(textwrap.dedent("""
        name: plugin
        steps: 30
        tasks: {bandit: {objective: bandit, params: {lr: 0.05}}}
        methods: [sync]
        staleness: [0, 4]
        seeds: [0]
    """))
    run = subprocess.run([sys.executable, "-m", "gacbench.cli", "bench", "--suite", str(suite), "--out",
                          str(tmp_path / "out"), "--methods", "geo-mask,gac+geo-mask", "--workers", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {c["method"] for c in summary["cells"] if c["status"] == "done"} == {"geo-mask", "gac+geo-mask"}
