"""Checkpoint-resume exactness: a run stopped at step k and resumed from its checkpoint ends with
the same parameters, and logs the same c_t, as an uninterrupted run."""

import re

import pytest
import torch
from conftest import UserRegressor, flat_params, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from gacbench import GAC, AlignmentMonitor, StalenessSimulator


def callbacks(kind):
    sim = StalenessSimulator(3, schedule="uniform", seed=5)
    if kind == "staleness":
        return [sim]
    if kind == "monitor":
        return [sim, AlignmentMonitor(warmup=0)]
    if kind == "gac":
        return [sim, GAC(c_low=0.05, c_high=0.3, warmup=0)]
    if kind == "gac-ema":
        return [sim, GAC(reference="ema", warmup=0)]
    if kind == "gac-applied":
        return [sim, GAC(reference="applied", warmup=0)]
    if kind in ("gac-compiled", "gac-fused-adamw"):  # the cached ||r||^2 travels in the checkpoint
        return [sim, GAC(c_low=0.05, c_high=0.3, warmup=0, kernels=kind.removeprefix("gac-"))]
    return [sim, GAC(reference="update", high_mode="skip", warmup=0)]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("kind", ["staleness", "monitor", "gac", "gac-ema", "gac-applied", "gac-update-skip",
                                  "gac-compiled", "gac-fused-adamw"])
def test_resume_is_exact(kind, tmp_path):
    """The uninterrupted run writes a periodic checkpoint at step 8 (an epoch boundary: Lightning
    itself resumes a plain dataloader exactly only there); a fresh trainer resumes from it."""
    total, cut = 16, 8
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=cut, save_top_k=-1)
    full = make_trainer([*callbacks(kind), ckpt_cb], max_steps=total, enable_checkpointing=True)
    model_full = UserRegressor(n=32, optimizer="adamw")  # 4 batches per epoch
    full.fit(model_full)
    ckpt = next(tmp_path.glob(f"*step={cut}.ckpt"))

    cbs = callbacks(kind)
    second = make_trainer(cbs, max_steps=total)
    model_b = UserRegressor(n=32, optimizer="adamw")
    with torch.no_grad():  # a different start: the checkpoint must win
        for p in model_b.parameters():
            p.add_(1.0)
    second.fit(model_b, ckpt_path=ckpt)

    assert torch.equal(flat_params(model_b), flat_params(model_full))
    for key in ("align/cos", "align/ref_cos", "stale/lag"):
        tail = full.logger.values(key)[-(total - cut):]
        assert second.logger.values(key) == tail
    assert cbs[0].step == total


def test_state_dict_round_trip():
    gac = GAC()
    make_trainer([StalenessSimulator(2), gac], max_steps=6).fit(UserRegressor())
    clone = GAC()
    clone.load_state_dict(gac.state_dict())
    assert clone.state_dict() == gac.state_dict()
    ckpt = {}
    gac.on_save_checkpoint(None, None, ckpt)
    clone.on_load_checkpoint(None, None, ckpt)
    saved, restored = gac.transform.state_dict(), clone.transform.state_dict()
    assert saved["has_ref"] and restored["has_ref"]
    assert torch.equal(restored["ref"], saved["ref"])


def test_resume_into_a_different_staleness_is_refused(tmp_path):
    first = make_trainer([StalenessSimulator(3)], max_steps=4)
    first.fit(UserRegressor(n=32))
    first.save_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match="staleness=3"):
        make_trainer([StalenessSimulator(5)], max_steps=8).fit(UserRegressor(n=32), ckpt_path=tmp_path / "a.ckpt")


@pytest.mark.parametrize("first,second,named", [
    (dict(schedule="fixed"), dict(schedule="trace", trace=[0]), "schedule='fixed'"),
    (dict(schedule="uniform", seed=1), dict(schedule="uniform", seed=2), "seed=1"),
    (dict(schedule="trace", trace=[0, 3]), dict(schedule="trace", trace=[3, 0]), "trace=[0, 3]"),
])
def test_resume_into_another_lag_schedule_is_refused(tmp_path, first, second, named):
    """The schedule, a uniform schedule's seed and a trace decide the lags as much as s does."""
    run = make_trainer([StalenessSimulator(3, **first)], max_steps=4)
    run.fit(UserRegressor(n=32))
    run.save_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(ValueError, match=re.escape(named)):
        make_trainer([StalenessSimulator(3, **second)], max_steps=8).fit(UserRegressor(n=32),
                                                                          ckpt_path=tmp_path / "a.ckpt")
    # a fixed schedule draws nothing: its seed is not part of the check
    run = make_trainer([StalenessSimulator(3, seed=1)], max_steps=4)
    run.fit(UserRegressor(n=32))
    run.save_checkpoint(tmp_path / "b.ckpt")
    make_trainer([StalenessSimulator(3, seed=2)], max_steps=6).fit(UserRegressor(n=32), ckpt_path=tmp_path / "b.ckpt")
