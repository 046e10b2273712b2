"""GACCallback in TRL's GRPOTrainer on the tiny warm-started model (CPU): the Trainer steps without a closure,
c_t and GAC's action reach trainer.state.log_history at every logged step, and GAC changes the training."""

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
    from accelerate.optimizer import AcceleratedOptimizer

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    assert inner_optimizer(AcceleratedOptimizer(opt, device_placement=False)) is opt
    assert inner_optimizer(opt) is opt
    with pytest.raises(UsageError, match="not a torch.optim.Optimizer"):
        inner_optimizer(object())
