"""GACCallback in TRL's GRPOTrainer on the tiny warm-started model (CPU): the Trainer steps without a closure,
c_t and GAC's action reach trainer.state.log_history at every logged step, and GAC changes the training."""

from types import SimpleNamespace

import pytest

trl = pytest.importorskip("trl")

import torch  # noqa: E402
from conftest import TINY_TASK  # noqa: E402

from gacbench.integrations.trl import GACCallback, inner_optimizer  # noqa: E402
from gacbench.usage import UsageError  # noqa: E402


def text_reward(completions, **kwargs):
    """A deterministic reward that varies within a group (the tiny model's exact-answer rewards, or its completion
    lengths, are often equal across a group: a zero gradient)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def grpo(model_dir, out_dir, callbacks):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gacbench.llm.task import ArithmeticTask

    rows = [{"prompt": p.prompt} for p in ArithmeticTask(**TINY_TASK, seed=0).batch("train", 0, 16)]
    args = trl.GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1,
        steps_per_generation=1, num_iterations=2,  # each generation trains two steps: aligned gradients
        max_completion_length=4, temperature=1.0, learning_rate=1e-2, lr_scheduler_type="constant",
        optim="adamw_torch", weight_decay=0.0, max_grad_norm=1.0, beta=0.0, max_steps=3, logging_steps=1,
        eval_strategy="no", save_strategy="no", report_to="none", use_cpu=True, bf16=False, fp16=False, seed=0,
        data_seed=0, shuffle_dataset=False, dataloader_num_workers=0, disable_tqdm=True, log_completions=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = trl.GRPOTrainer(model=model, processing_class=AutoTokenizer.from_pretrained(model_dir),
                              reward_funcs=text_reward, args=args, train_dataset=Dataset.from_list(rows),
                              callbacks=callbacks)
    trainer.train()
    return trainer, torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.slow
def test_gac_callback_in_grpo_trainer_logs_and_acts(tiny_llm_dir, tmp_path):
    cb = GACCallback(c_low=0.0, c_high=1e-6, warmup=0)  # any positive c_t: the aligned component is removed
    trainer, params = grpo(tiny_llm_dir, tmp_path / "gac", [cb])
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 3
    assert all("grad/norm" in h and "gac/action" in h for h in steps)
    assert all("align/cos" in h for h in steps[1:])  # c_t from the second step on
    # GAC runs inside optimizer.step, after the Trainer's clipping to max_grad_norm = 1 (grad_norm is pre-clip)
    assert [h["grad/norm"] for h in steps] == pytest.approx([min(h["grad_norm"], 1.0) for h in steps], rel=1e-5)
    assert cb.gac.steps == 3 and cb.gac.changed >= 1  # the reused generation gives an aligned gradient
    assert steps[-1]["align/proj_frac"] == pytest.approx(cb.gac.changed / 3)
    assert cb.summary["n"] == 2

    _, plain = grpo(tiny_llm_dir, tmp_path / "plain", [])
    assert not torch.equal(params, plain)


def test_settings_are_checked_when_the_callback_is_made():
    with pytest.raises(UsageError, match="c_low"):
        GACCallback(c_low=0.5, c_high=0.1)
    with pytest.raises(UsageError, match="unknown setting"):
        GACCallback(chigh=0.2)


def test_the_torch_optimizer_is_found_inside_accelerate_s_wrapper():
    from accelerate import Accelerator

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    wrapped = Accelerator(cpu=True).prepare_optimizer(opt, device_placement=False)
    assert type(wrapped) is not type(opt) and inner_optimizer(wrapped) is opt
    assert inner_optimizer(opt) is opt
    with pytest.raises(UsageError, match="not a torch.optim.Optimizer"):
        inner_optimizer(object())


def test_the_callback_drives_the_hooks_through_the_trainer_events():
    """The Trainer's events by hand: with reference="update" the monitor is attached first (c_t of the raw
    gradient) and each log adds the last step's values to the logs and to the entry log_history just received."""
    from conftest import UserRegressor
    from transformers import TrainerState

    model = UserRegressor(batch_size=4, lr=0.1, optimizer="adamw")
    opt = model.configure_optimizers()
    cb = GACCallback(reference="update", warmup=0)
    state = TrainerState()
    wrapper = type("Wrapper", (), {"optimizer": opt})()  # how accelerate wraps the Trainer's optimizer
    cb.on_train_begin(None, state, None, optimizer=wrapper)
    batches = list(model.train_dataloader())
    raw = []
    for t in range(4):
        opt.zero_grad()
        model.loss_fn(batches[t]).backward()
        raw.append(torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()]))
        opt.step()
        state.global_step = t + 1
        logs = {"loss": 1.0}
        state.log_history.append({**logs, "step": state.global_step})
        cb.on_log(None, state, None, logs=logs)
        assert logs.items() <= state.log_history[-1].items() and "grad/norm" in logs
        assert ("align/ref_cos" in logs) == (t > 0)
    cos = float(raw[3] @ raw[2] / (raw[3].norm() * raw[2].norm()))
    assert state.log_history[-1]["align/cos"] == pytest.approx(cos, rel=1e-5)
    assert state.log_history[-1]["gac/action"] in (0.0, 1.0, 2.0, 3.0)
    final = {"train_runtime": 1.0}  # the end-of-training log at the same step adds nothing
    cb.on_log(None, state, None, logs=final)
    assert final == {"train_runtime": 1.0}
    cb.on_train_end(None, state, None)
    assert cb.summary["n"] == 3
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    model.loss_fn(batches[0]).backward()
    opt.step()  # detached: a plain AdamW step, nothing recorded
    assert cb.gac.steps == 4 and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class Regressor(torch.nn.Module):
    """A model whose forward returns the loss, as a transformers.Trainer expects."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}


RESUMED = dict(c_low=0.05, c_high=0.3, reference="ema", warmup=0)  # keep, shrink and project over 8 steps


def regress(out_dir, settings=RESUMED, resume=None, args_resume=None):
    """8 steps of a plain Trainer with a checkpoint every 4; returns the final parameters and the callback."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    data = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(80)]
    model = Regressor()
    cb = GACCallback(**settings)
    args = TrainingArguments(output_dir=str(out_dir), max_steps=8, per_device_train_batch_size=8, logging_steps=1,
                             learning_rate=0.05, save_strategy="steps", save_steps=4, report_to=[], use_cpu=True,
                             disable_tqdm=True, resume_from_checkpoint=args_resume)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train(resume_from_checkpoint=resume)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), cb


def test_a_resumed_trainer_continues_gac_exactly(tmp_path):
    """GAC's reference (an EMA here), counters and c_t trace travel in the Trainer's checkpoint: resumed from
    step 4, in its own output_dir or from a folder named in TrainingArguments, the run ends with the
    uninterrupted run's parameters bit for bit and the same c_t trace; without the state file it warns and
    the run differs."""
    import shutil

    from gacbench.integrations.trl import STATE_FILE

    full, cb = regress(tmp_path / "full")
    assert cb.gac.steps == 8 and 0 < cb.gac.changed < 8
    saved = tmp_path / "full" / "checkpoint-4"
    assert (saved / STATE_FILE).is_file()

    shutil.copytree(saved, tmp_path / "same" / "checkpoint-4")  # resume_from_checkpoint=True finds it
    same, cb_same = regress(tmp_path / "same", resume=True)
    named, cb_named = regress(tmp_path / "named", resume=str(saved), args_resume=str(saved))
    for params, resumed in ((same, cb_same), (named, cb_named)):
        assert torch.equal(params, full)
        assert resumed.gac.values == cb.gac.values and resumed.gac.changed == cb.gac.changed
        assert resumed.summary == cb.summary

    (saved / STATE_FILE).unlink()
    with pytest.warns(UserWarning, match="holds no gacbench_gac.pt"):
        lost, cb_lost = regress(tmp_path / "lost", resume=str(saved), args_resume=str(saved))
    assert not torch.equal(lost, full) and len(cb_lost.gac.values) < len(cb.gac.values)


def test_a_resumed_trainer_refuses_gac_state_of_other_settings_or_another_step(tmp_path):
    import shutil

    from gacbench.integrations.trl import STATE_FILE

    regress(tmp_path / "full")
    saved = tmp_path / "full" / "checkpoint-4"
    with pytest.raises(UsageError, match="resume with the same settings"):
        regress(tmp_path / "other", settings={**RESUMED, "c_high": 0.4}, resume=str(saved), args_resume=str(saved))
    # the same settings written otherwise (a default given or left out) resume
    regress(tmp_path / "same", settings={**RESUMED, "shrink": "component"}, resume=str(saved), args_resume=str(saved))
    shutil.copy(tmp_path / "full" / "checkpoint-8" / STATE_FILE, saved / STATE_FILE)
    with pytest.raises(UsageError, match="state at step 8, but training resumes at step 4"):
        regress(tmp_path / "moved", resume=str(saved), args_resume=str(saved))


def test_a_checkpoint_of_settings_given_as_numpy_numbers_resumes(tmp_path):
    """Thresholds read from numpy (np.float64, np.int64) are stored as Python numbers: the state file loads with
    torch.load(weights_only=True), the resumed run ends with the uninterrupted run's parameters bit for bit, and
    that run is the one the same settings as Python floats give."""
    import numpy as np

    from gacbench.integrations.trl import STATE_FILE

    numpy_settings = {**RESUMED, "c_low": np.float64(0.05), "c_high": np.float64(0.3), "warmup": np.int64(0)}
    full, cb = regress(tmp_path / "full", settings=numpy_settings)
    saved = tmp_path / "full" / "checkpoint-4"
    state = torch.load(saved / STATE_FILE, weights_only=True)
    assert state["settings"] == {**RESUMED, "c_low": 0.05, "c_high": 0.3, "warmup": 0}
    assert [type(state["settings"][k]) for k in ("c_low", "c_high", "warmup")] == [float, float, int]
    resumed, cb_resumed = regress(tmp_path / "resumed", settings=numpy_settings, resume=str(saved),
                                  args_resume=str(saved))
    plain, _ = regress(tmp_path / "plain")
    assert torch.equal(resumed, full) and torch.equal(full, plain)
    assert cb_resumed.gac.values == cb.gac.values


# the folder named in resume_from_checkpoint comes before output_dir/checkpoint-<step>
def test_gac_state_is_read_from_the_named_checkpoint_first(tmp_path):
    from gacbench.integrations.trl import GACCallback

    cb = GACCallback(warmup=0)
    p = torch.nn.Parameter(torch.zeros(2))
    out, other = tmp_path / "out", tmp_path / "other"
    cb.on_train_begin(SimpleNamespace(output_dir=str(out)), SimpleNamespace(global_step=0), None,
                      optimizer=torch.optim.SGD([p], lr=0.1))
    at3 = SimpleNamespace(global_step=3)
    cb.gac.values = [0.1]
    cb.on_save(SimpleNamespace(output_dir=str(out)), at3, None)  # out/checkpoint-3: this output_dir's run
    cb.gac.values = [0.2]
    cb.on_save(SimpleNamespace(output_dir=str(other)), at3, None)  # other/checkpoint-3: the one resumed from
    cb.gac.values = []
    cb._resume(SimpleNamespace(output_dir=str(out), resume_from_checkpoint=str(other / "checkpoint-3")), 3)
    assert cb.gac.values == [0.2]
