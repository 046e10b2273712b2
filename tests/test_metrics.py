"""gacbench's per-step metrics are Lightning-native: they reach trainer.callback_metrics (so that
EarlyStopping and ModelCheckpoint can monitor c_t), the progress bar, and every logger."""

import math

import lightning.pytorch as pl
import pytest
import torch
from conftest import UserRegressor, make_trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, TQDMProgressBar

from gacbench import GAC, AlignmentMonitor, StalenessSimulator

STEPS_PER_EPOCH = 8  # UserRegressor(n=64, batch_size=8)


def epoch_end_values(logger, key: str) -> list[float]:
    """The value logged at the last optimizer step of each epoch (what epoch-end callbacks see)."""
    return [v for step, v in logger.series[key] if step % STEPS_PER_EPOCH == STEPS_PER_EPOCH - 1]


def test_early_stopping_on_align_cos_stops_a_plain_module():
    es = EarlyStopping(monitor="align/cos", mode="min", patience=2, check_on_train_epoch_end=True)
    max_epochs = 30
    trainer = make_trainer([StalenessSimulator(4), AlignmentMonitor(warmup=0), es], max_steps=-1, max_epochs=max_epochs)
    trainer.fit(UserRegressor(n=64))

    # Replay EarlyStopping's rule on the c_t the logger received at each epoch end: it must stop
    # exactly where the callback stopped, so the callback saw the same values.
    best, wait, expected_stop = math.inf, 0, None
    for epoch, c in enumerate(epoch_end_values(trainer.logger, "align/cos")):
        if c < best:
            best, wait = c, 0
        else:
            wait += 1
        if wait >= es.patience:
            expected_stop = epoch
            break
    assert expected_stop is not None and expected_stop < max_epochs - 1
    assert es.stopped_epoch == expected_stop
    assert trainer.global_step == STEPS_PER_EPOCH * (expected_stop + 1)  # no step after the stopping epoch
    assert float(es.best_score) == best


def test_model_checkpoint_keeps_the_best_logged_c_t(tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="align/cos", mode="max", save_top_k=1)
    trainer = make_trainer([StalenessSimulator(4), GAC(warmup=0), ckpt], max_steps=-1, max_epochs=4,
                           enable_checkpointing=True)
    trainer.fit(UserRegressor(n=64, optimizer="adamw"))
    ends = epoch_end_values(trainer.logger, "align/cos")
    assert len(ends) == 4
    assert float(ckpt.best_model_score) == max(ends)  # exactly the logged c_t, not a rounded copy
    best_epoch = ends.index(max(ends))
    assert ckpt.best_model_path.endswith(f"epoch={best_epoch}-step={STEPS_PER_EPOCH * (best_epoch + 1)}.ckpt")
    saved = torch.load(ckpt.best_model_path, weights_only=False)
    assert saved["global_step"] == STEPS_PER_EPOCH * (best_epoch + 1)


def test_callback_metrics_hold_what_the_loggers_got():
    gac = GAC(warmup=1)
    trainer = make_trainer([StalenessSimulator(3), gac], max_steps=10)
    trainer.fit(UserRegressor(optimizer="adamw"))
    metrics = trainer.callback_metrics
    for key in ("align/cos", "grad/norm", "align/proj_frac", "align/skip", "gac/coef", "stale/lag"):
        value = metrics[key]
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point(), key
        assert float(value) == trainer.logger.last(key), key
    assert float(metrics["stale/lag"]) == 3.0
    # the end-of-fit summary too
    assert float(metrics["align/q90_abs"]) == gac.summary["q90_abs"] == trainer.logger.last("align/q90_abs")
    assert float(metrics["align/median"]) == gac.summary["median"]


class CallbackMetricsTap(pl.Callback):
    """Reads trainer.callback_metrics in on_before_optimizer_step, after the callbacks listed before it."""

    def __init__(self, key):
        self.key, self.values = key, []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.values.append(float(trainer.callback_metrics[self.key]) if self.key in trainer.callback_metrics else None)


def test_callback_metrics_update_every_step_while_loggers_write_every_n_steps():
    mon, tap = AlignmentMonitor(warmup=0), CallbackMetricsTap("align/cos")
    trainer = make_trainer([StalenessSimulator(2), mon, tap], max_steps=10, log_every_n_steps=4)
    trainer.fit(UserRegressor())
    assert tap.values[0] is None  # the first step has no previous gradient
    assert tap.values[1:] == mon.trace.values  # every step's c_t, as the monitor computed it
    logged = trainer.logger.series["align/cos"]
    assert [step for step, _ in logged] == [4, 8]
    assert [v for _, v in logged] == [mon.trace.values[3], mon.trace.values[7]]


def test_progress_bar_shows_c_t():
    bar = TQDMProgressBar()
    mon = AlignmentMonitor(warmup=0)
    trainer = make_trainer([StalenessSimulator(2), mon, bar], max_steps=6, enable_progress_bar=True)
    model = UserRegressor()
    trainer.fit(model)
    shown = bar.get_metrics(trainer, model)
    assert shown["align/cos"] == mon.trace.values[-1]
    assert "grad/norm" not in shown and "grad/norm" in trainer.callback_metrics  # the bar shows c_t only


@pytest.mark.parametrize("every", [1, 3])
def test_the_logger_write_stays_on_its_schedule(every):
    trainer = make_trainer([StalenessSimulator(3)], max_steps=9, log_every_n_steps=every)
    trainer.fit(UserRegressor())
    assert [s for s, _ in trainer.logger.series["stale/lag"]] == list(range(0, 9, every))
    assert float(trainer.logged_metrics["stale/lag"]) == trainer.logger.last("stale/lag")
