"""GRPOModule with the HF engine on the tiny warm-started model: exact lag, behaviour log-probs,
weight sync every step, loss-side and gradient-side stabilizers, exact resume, errors."""

import functools
import math
import re

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from conftest import TINY_TASK, make_trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import gacbench.llm.grpo as grpo  # noqa: E402
from gacbench import GAC  # noqa: E402
from gacbench.llm.grpo import GRPOModule  # noqa: E402
from gacbench.rollout.engines import sequence_logprobs  # noqa: E402
from gacbench.rollout.queue import StaleRolloutQueue  # noqa: E402
from gacbench.stabilizers import M2PO  # noqa: E402

TASK = TINY_TASK


@pytest.fixture(scope="module")
def model_dir(tiny_llm_dir):
    return tiny_llm_dir


SECTIONS = {"engine": ("engine", "name"), "prompts": ("rollout", "prompts"), "group": ("rollout", "group"),
            "max_tokens": ("rollout", "max_tokens"), "advantage": ("rollout", "advantage"),
            "clip_low": ("loss", "clip_low"), "clip_high": ("loss", "clip_high"), "agg": ("loss", "agg"),
            "kl_coef": ("loss", "kl_coef"), "max_ops": ("task", "max_ops"), "max_operand": ("task", "max_operand")}


def grpo_args(model_dir, **kw) -> dict:
    """GRPOModule's arguments from flat settings: each known key goes to its section."""
    flat = dict(staleness=0, prompts=4, group=4, max_tokens=4, lr=3e-4, steps=8, engine="hf", **TASK)
    flat.update(kw)
    args: dict = {"model": {"path": model_dir}}
    for key, value in flat.items():
        if key in SECTIONS:
            section, field = SECTIONS[key]
            args.setdefault(section, {})[field] = value
        else:
            args[key] = value
    return args


def module(model_dir, **kw):
    return GRPOModule(**grpo_args(model_dir, **kw))


def test_consumed_batch_is_exactly_s_versions_old_and_engine_follows(model_dir):
    m = module(model_dir, staleness=3)
    trainer = make_trainer([], max_steps=8)
    trainer.fit(m)
    assert trainer.logger.values("stale/lag") == [min(3, t) for t in range(8)]
    assert m.engine.version == 8  # synced after every optimizer step
    assert max(abs(x) for x in trainer.logger.values("is/engine_mismatch_kl")) < 1e-5


def test_behaviour_log_probs_are_the_trainers_at_generation_time(model_dir):
    m = module(model_dir, staleness=1)
    make_trainer([], max_steps=1).fit(m)
    data = m.rollout()
    packed = data["packed"]
    assert len(set(packed["prompt_len"].tolist())) > 1  # rows with different prompt lengths are covered
    for i in range(packed["ids"].shape[0]):
        p = int(packed["prompt_len"][i])
        n = int(packed["mask"][i].sum())
        ids = packed["ids"][i, : p + n].tolist()
        ref = sequence_logprobs(m.policy, ids[:p], ids[p:])
        assert torch.allclose(data["logp_behav"][i, :n], ref, atol=1e-5)
        assert torch.allclose(data["engine_logp"][i, :n], ref, atol=1e-4)


def test_synchronous_ratio_is_one_and_nothing_is_clipped(model_dir):
    trainer = make_trainer([], max_steps=4)
    trainer.fit(module(model_dir))
    assert trainer.logger.values("is/ratio_mean") == pytest.approx([1.0] * 4, abs=1e-5)
    assert trainer.logger.values("pg/clipfrac") == [0.0] * 4


def test_gac_and_m2po_act_in_grpo(model_dir):
    trainer = make_trainer([GAC(warmup=0), M2PO()], max_steps=6)
    trainer.fit(module(model_dir, staleness=2))
    assert len(trainer.logger.values("m2po/m2")) == len(trainer.logger.values("m2po/masked_frac")) == 6  # M2PO's loss
    # GAC measured c_t (a step whose groups all tie has no gradient)
    assert len(trainer.logger.values("align/cos")) >= 3


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`", "ignore:You're resuming from a checkpoint")
def test_resume_in_the_middle_of_a_stale_run_is_exact(model_dir, tmp_path):
    full = module(model_dir, staleness=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    make_trainer([ckpt], max_steps=8, enable_checkpointing=True).fit(full)
    resumed = module(model_dir, staleness=2)
    trainer = make_trainer([], max_steps=8)
    trainer.fit(resumed, ckpt_path=next(tmp_path.glob("*step=4.ckpt")))
    assert trainer.logger.values("stale/lag") == [2, 2, 2, 2]
    for a, b in zip(full.policy.parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b)
    # the checkpointing run makes the batches a longer resume would need; the resumed one (no checkpoints) does not
    assert full.queue.versions == [6, 7] and full.rollouts_made == 10
    assert resumed.queue.versions == [] and resumed.rollouts_made == 8


def test_no_rollout_is_made_past_the_last_step_and_the_run_is_the_same(model_dir, monkeypatch):
    """The queue told the run's last step skips the s rollouts no step would consume; every logged value and
    the final weights equal those of the run that makes them."""
    def fit(cut):
        m = module(model_dir, staleness=3)
        trainer = make_trainer([], max_steps=6)
        if not cut:
            step = StaleRolloutQueue.step
            monkeypatch.setattr(StaleRolloutQueue, "step", lambda q, t, produce, last_step=None: step(q, t, produce))
        trainer.fit(m)
        monkeypatch.undo()
        return m, trainer.logger

    (cut, cut_log), (full, full_log) = fit(True), fit(False)
    assert (cut.rollouts_made, full.rollouts_made) == (6, 9)
    keys = [k for k in full_log.series if not k.startswith("time/")]
    assert "reward/mean" in keys and "is/ratio_mean" in keys and set(keys) <= set(cut_log.series)
    for k in keys:  # equal bit for bit (repr: a NaN equals a NaN)
        assert [repr(v) for v in cut_log.values(k)] == [repr(v) for v in full_log.values(k)], k
    for a, b in zip(cut.policy.parameters(), full.policy.parameters()):
        assert torch.equal(a, b)


def test_bad_settings_are_refused(model_dir, tmp_path):
    with pytest.raises(ValueError, match="engine.name='sglang' is not a registered engine"):
        module(model_dir, engine="sglang")
    with pytest.raises(ValueError, match="unknown rollout setting.*promts"):
        GRPOModule(model={"path": model_dir}, rollout={"promts": 4})
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        module(model_dir, advantage="ppo-gae")
    with pytest.raises(ValueError, match="staleness"):
        module(model_dir, staleness=-1)
    with pytest.raises(ValueError, match="model.path=.* is not a local Hugging Face checkpoint directory"):
        module(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"engine.compile=true is for the vllm engine in float32 \(this run: "
                                         r"engine.name='hf', engine.dtype='float32'\)"):
        GRPOModule(model={"path": model_dir}, engine={"name": "hf", "compile": True})
    with pytest.raises(ValueError, match="engine.dtype='bfloat16'"):
        GRPOModule.check_settings({"engine": {"name": "vllm", "dtype": "bfloat16", "compile": True}})
    with pytest.raises(ValueError, match="engine.compile='yes' must be true or false"):
        GRPOModule.check_settings({"engine": {"name": "vllm", "compile": "yes"}})
    GRPOModule.check_settings({"engine": {"name": "vllm", "compile": True}})  # accepted: checked without an engine


def _counted(calls: dict, key: str, forward, *args, **kwargs):
    calls[key] += 1
    return forward(*args, **kwargs)


def _packed_batch(seed: int = 0) -> dict:
    """A hand-made packed batch of 7 rows of unequal prompt and completion lengths (right padding)."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.tensor([5, 6, 7, 5, 8, 6, 5])
    lens = prompt_len + torch.tensor([10, 12, 9, 13, 12, 7, 15])
    attention = (torch.arange(int(lens.max())).unsqueeze(0) < lens.unsqueeze(1)).long()
    ids = torch.randint(3, 18, attention.shape, generator=g) * attention
    mask = torch.arange(int((lens - prompt_len).max())).unsqueeze(0) < (lens - prompt_len).unsqueeze(1)
    return {"ids": ids, "attention": attention, "mask": mask, "prompt_len": prompt_len}


def test_logit_rows_and_gradient_checkpointing_keep_the_log_probs_and_gradients(model_dir):
    """model.logit_rows (the output layer on a few rows' completion positions at a time, recomputed in the
    backward pass) and model.gradient_checkpointing (each decoder layer recomputed in the backward pass) give the
    whole-batch path's log-probs bit for bit and its gradients within rounding, and do recompute: each decoder
    layer runs twice per forward and backward with checkpointing, the output layer once per chunk in each pass."""
    packed = _packed_batch()
    weights = torch.linspace(-1, 1, packed["mask"].numel()).view(packed["mask"].shape)

    def run(**model):
        m = GRPOModule(**{**grpo_args(model_dir), "model": {"path": model_dir, **model}})
        calls = {"layer": 0, "head": 0}
        # counted by their forward methods: module hooks do not run in a checkpoint's recomputation
        for key, mod in (("layer", m.policy.get_decoder().layers[0].mlp), ("head", m.policy.get_output_embeddings())):
            mod.forward = functools.partial(_counted, calls, key, mod.forward)
        lp = m.token_logprobs(packed)
        (lp * weights).sum().backward()
        with torch.no_grad():
            assert torch.equal(m.frozen_logprobs(packed), lp.detach())
        return lp.detach(), [p.grad for p in m.policy.parameters()], calls

    lp0, g0, calls0 = run()
    assert calls0 == {"layer": 2, "head": 2}  # the backward recomputes nothing; +1 each for the frozen pass
    for model, calls in [({"logit_rows": 3}, {"layer": 2, "head": 3 * 2 + 3}),
                         ({"gradient_checkpointing": True}, {"layer": 3, "head": 2}),
                         ({"gradient_checkpointing": True, "logit_rows": 7}, {"layer": 3, "head": 3})]:
        lp, g, seen = run(**model)
        assert seen == calls, model
        assert torch.equal(lp, lp0), model
        scale = max(float(x.abs().max()) for x in g0)
        assert max(float((x - y).abs().max()) for x, y in zip(g, g0)) <= 1e-6 * scale, model


def test_a_stale_run_with_logit_rows_and_checkpointing_trains_as_the_default_one(model_dir):
    """Three steps at s = 1 (behaviour log-probs, the training forward and backward) with both memory settings:
    the same lags and rewards, every importance and clipping diagnostic and the final weights within rounding."""
    runs, weights = [], []
    for model in ({}, {"gradient_checkpointing": True, "logit_rows": 3}):
        m = GRPOModule(**{**grpo_args(model_dir, staleness=1, steps=3), "model": {"path": model_dir, **model}})
        trainer = make_trainer([], max_steps=3)
        trainer.fit(m)
        runs.append({k: v for k, v in trainer.logger.series.items() if not k.startswith("time/")})
        weights.append([p.detach().clone() for p in m.policy.parameters()])
    assert [v for _, v in runs[1]["stale/lag"]] == [v for _, v in runs[0]["stale/lag"]] == [0, 1, 1]
    assert runs[1]["reward/mean"] == runs[0]["reward/mean"]
    diagnostics = [k for k in runs[0] if k.startswith(("is/", "pg/"))]
    assert len(diagnostics) >= 5 and set(runs[1]) == set(runs[0])
    for key in diagnostics:
        assert [v for _, v in runs[1][key]] == pytest.approx([v for _, v in runs[0][key]], rel=1e-4, abs=1e-6), key
    assert max(float((a - b).abs().max()) for a, b in zip(*weights)) < 1e-5


def test_memory_settings_are_checked(model_dir):
    with pytest.raises(ValueError, match="model.logit_rows=0"):
        GRPOModule.check_settings({"model": {"logit_rows": 0}})
    with pytest.raises(ValueError, match="model.logit_rows=2.5"):
        GRPOModule.check_settings({"model": {"logit_rows": 2.5}})
    with pytest.raises(ValueError, match="model.gradient_checkpointing='yes' must be true or false"):
        GRPOModule.check_settings({"model": {"gradient_checkpointing": "yes"}})
    m = module(model_dir)
    m.policy.config.final_logit_softcapping = 30.0  # as Gemma's: the logits are not the head's output alone
    with pytest.raises(ValueError, match=r"sets final_logit_softcapping\); set model.logit_rows: null"):
        grpo.check_plain_logits(m.policy)
    m.policy.config.final_logit_softcapping = None
    grpo.check_plain_logits(m.policy)
    # logits transformed where no config key says so: found by comparing the two routes on a few tokens
    hook = m.policy.register_forward_hook(lambda mod, args, out: setattr(out, "logits", out.logits * 2) or out)
    with pytest.raises(ValueError, match=r"the two differ by up to .* on 8 tokens\); set model.logit_rows: null"):
        grpo.check_plain_logits(m.policy)
    assert m.policy.training  # its mode is given back
    hook.remove()
    grpo.check_plain_logits(m.policy)


def test_a_cells_policy_evaluations_are_its_eval_time_and_no_steps(model_dir, tmp_path, monkeypatch):
    """The policy reward's evaluations (θ_0's before the first step, then every few steps) are counted in the cell's
    ``eval`` part: none of them inside a timed optimizer step or in the trainer's remainder."""
    import csv
    import time

    from gacbench.bench.cell import cell_dir, run_cell

    pause = 2.0  # an evaluation counted in a step or in the trainer's remainder would take it above this
    real = GRPOModule.policy_reward

    def slow(self):
        time.sleep(pause)
        return real(self)

    monkeypatch.setattr(GRPOModule, "policy_reward", slow)
    params = {k: v for k, v in grpo_args(model_dir, eval_every=2, eval_size=4).items()
              if k not in ("staleness", "steps")}
    cell = {"task": "arith", "objective": "grpo", "steps": 3, "warmup": 0, "method": "sync", "staleness": 0, "seed": 0,
            "params": {**params, "policy_eval": {"prompts": 2, "samples": 2, "every": 2}}}
    status = run_cell(cell, tmp_path)
    assert status["status"] == "done", status.get("error")
    rows = list(csv.DictReader((cell_dir(tmp_path, cell) / "metrics.csv").open()))
    versions = [float(r["eval/policy_version"]) for r in rows if r.get("eval/policy_version")]
    assert versions == [0.0, 2.0, 3.0]
    parts = status["time"]
    assert parts["eval"] >= len(versions) * pause
    assert parts["steps"] < pause and parts["trainer"] < pause  # 3 steps of a tiny model: well under 2 s


def test_grpo_cells_run_through_the_bench_runner_with_their_engine(model_dir, tmp_path):
    from gacbench.bench.report import build_report
    from gacbench.bench.runner import run_grid

    base = {"task": "arith", "objective": "grpo", "steps": 4, "warmup": 0,
            "params": {k: v for k, v in grpo_args(model_dir, eval_every=2, eval_size=8).items()
                       if k not in ("staleness", "steps")}}
    cells = [{**base, "method": "sync", "staleness": 0, "seed": 0},
             {**base, "method": "gac", "staleness": 2, "seed": 0}]

    assert run_grid(cells, tmp_path)["failed"] == 0
    summary = build_report(tmp_path, cells)["summary"]
    assert {c["engine"] for c in summary["cells"]} == {"hf"}
    import json

    from gacbench.bench.cell import cell_dir
    from gacbench.provenance import weights_sha256

    for cell in cells:  # the checkpoint each cell started from, in its provenance
        prov = json.loads((cell_dir(tmp_path, cell) / "config.json").read_text())["provenance"]
        assert prov["initial_weights"] == weights_sha256(model_dir)
    # one code version; the one start point of the task is not part of its key (weights count only where a task's
    # cells started from more than one)
    assert len(summary["versions"]) == 1 and " weights " not in summary["versions"][0]["key"]
    assert all(c["metric"] == "acc" and 0.0 <= c["final"] <= 1.0 for c in summary["cells"])
    import csv

    rows = list(csv.DictReader((cell_dir(tmp_path, cells[1]) / "metrics.csv").open()))
    generate = [float(r["time/generate_s"]) for r in rows if r.get("time/generate_s")]
    assert len(generate) == 4 and min(generate[:2]) > 0 and generate[2:] == [0.0, 0.0]  # no batch past the end


def test_grpo_loss_with_kl_equals_a_hand_computation(model_dir):
    m = module(model_dir, staleness=1, kl_coef=0.3, clip_low=0.1, clip_high=0.25)
    make_trainer([], max_steps=1).fit(m)
    data = m.rollout()  # behaviour log-probs of the current weights
    with torch.no_grad():  # move the policy so that ratios differ from 1 and some are clipped
        for p in m.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    loss, metrics = m.policy_loss(data)
    ref = m._ref[0]
    packed, total, tokens, kl_sum = data["packed"], 0.0, 0, 0.0
    for i in range(packed["ids"].shape[0]):
        p, n = int(packed["prompt_len"][i]), int(packed["mask"][i].sum())
        ids = packed["ids"][i, : p + n].tolist()
        new = sequence_logprobs(m.policy, ids[:p], ids[p:]).tolist()
        old = data["logp_behav"][i, :n].tolist()
        r_ref = sequence_logprobs(ref, ids[:p], ids[p:]).tolist()
        a = float(data["adv"][i])
        for k in range(n):
            ratio = float(torch.tensor(new[k] - old[k]).exp())
            total += -min(ratio * a, min(max(ratio, 0.9), 1.25) * a)
            d = r_ref[k] - new[k]
            kl_sum += float(torch.tensor(d).exp()) - d - 1.0
            tokens += 1
    assert float(metrics["pg/clipfrac"]) > 0.0  # the check exercises clipping
    assert loss.item() == pytest.approx(total / tokens + 0.3 * kl_sum / tokens, rel=1e-4, abs=1e-6)
    assert float(metrics["kl/ref"]) == pytest.approx(kl_sum / tokens, rel=1e-4, abs=1e-7)


def test_kl_to_reference_is_zero_before_the_policy_moves(model_dir):
    trainer = make_trainer([], max_steps=2)
    trainer.fit(module(model_dir, kl_coef=0.1))
    kl = trainer.logger.values("kl/ref")
    assert abs(kl[0]) < 1e-6 and kl[1] > 0.0


def _raise(*args, **kwargs):
    raise ConnectionError("engine process exited")


@pytest.mark.parametrize("break_, match", [
    ("generate", "hf rollout engine failed at version 0 .*ConnectionError.*resume from the last checkpoint"),
    ("load_weights", "weight sync to the hf engine failed at version 1"),
    ("silent-sync", "engine holds version 0, the trainer is at 1"),
])
def test_a_dead_or_unsynced_engine_stops_the_run(model_dir, break_, match):
    m = module(model_dir)
    start = m.on_train_start

    def broken_start():
        start()
        if break_ == "silent-sync":  # a sync that returns without loading: the next rollout must not happen
            m.engine.load_weights = lambda state_dict, version: None
        else:
            setattr(m.engine, break_, _raise)

    m.on_train_start = broken_start
    with pytest.raises(RuntimeError, match=match):
        make_trainer([], max_steps=3).fit(m)


@pytest.mark.parametrize("policy_eval", [False, True])
def test_a_dead_engine_stops_the_run_and_is_not_handed_to_a_later_run(model_dir, policy_eval):
    """Whether it fails in a rollout or in the policy evaluation at θ_0, which comes first."""
    from gacbench.rollout.engines import cached_engine

    settings = {"policy_eval": {"prompts": 2, "samples": 2, "every": 2}} if policy_eval else {}
    m = module(model_dir, **settings)
    start = m.on_train_start

    def broken_start():
        start()
        m.engine.generate = _raise

    m.on_train_start = broken_start
    with pytest.raises(RuntimeError, match="hf rollout engine failed at version 0 .*ConnectionError.*resume"):
        make_trainer([], max_steps=3).fit(m)
    assert cached_engine("hf") is None


def test_a_prompt_longer_than_the_context_is_refused(model_dir):
    with pytest.raises(ValueError, match="max_tokens=80 leaves no room for a prompt in the model's context of 64"):
        module(model_dir, max_tokens=80)  # the tiny model's context is 64 tokens: refused with the settings
    m = module(model_dir, max_tokens=62)  # room for a prompt of 2 tokens, not for these
    with pytest.raises(ValueError, match="exceeds the model's context of 64 tokens.*Lower max_tokens"):
        make_trainer([], max_steps=1).fit(m)


def test_step_times_split_generation_from_training(model_dir):
    m = module(model_dir, staleness=1)
    trainer = make_trainer([], max_steps=3)
    trainer.fit(m)
    gen = trainer.logger.values("time/generate_s")
    assert len(gen) == 3 and min(gen[:2]) > 0.0 and m.rollouts_made == 3  # step 0 fills the pipeline
    assert gen[2] == 0.0  # step 2 is the last: the batch it would make (for step 3) is not made
    stats = m.run_stats
    assert 0.0 < stats["generate_share"] < 1.0 and stats["generated_tokens"] > 0


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_cell_is_bit_identical_fresh_or_after_another_cell_in_the_same_worker(model_dir, tmp_path, engine):
    """The bench runner keeps one worker (and its rollout engine) across cells: a cell run first, in a process
    holding no engine, and the same cell run after a different one must store the same metrics."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    from gacbench.bench.cell import cell_dir, run_cell
    from gacbench.rollout.engines import cached_engine, release_engines

    params = {k: v for k, v in grpo_args(model_dir, engine=engine, eval_every=2, eval_size=8).items()
              if k not in ("staleness", "steps")}
    cell = {"task": "arith", "objective": "grpo", "steps": 4, "warmup": 0, "params": params, "method": "gac+m2po",
            "staleness": 2, "seed": 3}
    other = {**cell, "method": "stale", "staleness": 1, "seed": 5}
    release_engines()
    assert run_cell(cell, tmp_path / "fresh")["status"] == "done"
    first = cached_engine(engine)
    assert run_cell(other, tmp_path / "reused")["status"] == "done"
    assert run_cell(cell, tmp_path / "reused")["status"] == "done"
    assert cached_engine(engine) is first  # one engine served all three cells

    def rows(root):
        text = (cell_dir(root, cell) / "metrics.csv").read_text().splitlines()
        header = text[0].split(",")
        keep = [i for i, k in enumerate(header) if not k.startswith("time/")]  # wall-clock columns differ
        return [[line.split(",")[i] for i in keep] for line in text]

    fresh, reused = rows(tmp_path / "fresh"), rows(tmp_path / "reused")
    assert len(fresh) > 4 and fresh == reused
    if engine == "vllm":
        release_engines()  # give the engine's memory back to the rest of the test session


def test_an_engine_a_task_and_an_estimator_registered_from_outside_train_grpo(model_dir):
    """Extending GRPO is one registration each: a counting engine (wrapping the hf one), a task of additions
    only, and a sign advantage; a run with all three uses all three."""
    from gacbench.llm import tasks
    from gacbench.llm.task import ArithmeticTask
    from gacbench.rollout import advantages, engines

    calls = {"engine": 0, "task": 0, "adv": 0}

    class CountingEngine(engines.HFEngine):
        def generate(self, *args, **kwargs):
            calls["engine"] += 1
            return super().generate(*args, **kwargs)

    @engines.register_engine("test-counting")
    def _engine(spec, *, model_path, policy, eos_token_id, pad_token_id, max_model_len, seed):
        return CountingEngine(policy, eos_token_id, pad_token_id)

    class Additions:
        default_reward = "exact"
        tiny_tokenizer = True

        def __init__(self, seed):
            self.inner = ArithmeticTask(max_ops=1, max_operand=4, seed=seed)

        def batch(self, split, start, size):
            calls["task"] += 1
            return [p for p in self.inner.batch(split, start, 4 * size) if "+" in p.prompt][:size]

    @tasks.register_task("test-additions")
    def _task(cfg, seed):
        return Additions(seed)

    @advantages.register_advantage("test-sign")
    def _sign(rewards):
        calls["adv"] += 1
        return torch.sign(rewards - rewards.mean(-1, keepdim=True))

    try:
        args = grpo_args(model_dir, engine="test-counting", advantage="test-sign", steps=3)
        m = GRPOModule(**{**args, "task": {"name": "test-additions"}})
        trainer = make_trainer([], max_steps=3)
        trainer.fit(m)
        assert all(p.prompt.count("+") == 1 for p in m.task.batch("train", 0, 4))
        assert calls["engine"] >= 3 and calls["task"] >= 3 and calls["adv"] == 3
        assert type(m.engine) is CountingEngine and len(trainer.logger.values("reward/mean")) == 3
    finally:
        engines.release_engines("test-counting")
        engines.ENGINES.pop("test-counting")
        tasks.TASKS.pop("test-additions")
        advantages.ADVANTAGES.pop("test-sign")


def _every_stabilizer() -> list[str]:
    from gacbench.stabilizers.registry import available

    return sorted(available())


@pytest.mark.parametrize("method", _every_stabilizer())
def test_every_registered_stabilizer_runs_in_grpo(model_dir, method):
    """A short smoke cell per method: every stabilizer of `gacbench stabilizers` trains GRPO from stale rollouts
    (loss-side ones through PolicyBatch with the module's settings, gradient-side ones on the gradients)."""
    from gacbench.methods import method_callbacks

    trainer = make_trainer(method_callbacks(method), max_steps=3)
    m = module(model_dir, staleness=1, clip_high=0.28, agg="seq-mean-token-mean")
    trainer.fit(m)
    assert len(trainer.logger.values("reward/mean")) == 3 and m.engine.version == 3
    assert all(torch.isfinite(p).all() for p in m.policy.parameters())


def test_row_logp_recomputes_the_batch_log_probs_and_vcpo_gradient_norms(model_dir, monkeypatch):
    """PolicyBatch.row_logp gives a row's log-probs from a forward of that row alone; VCPO's per-sequence gradient
    norms from it equal those taken through the whole batch's graph."""
    import gacbench.llm.grpo as grpo
    from gacbench.stabilizers.vcpo import per_sequence_grad_sq_norms, recomputed_grad_sq_norms

    m = module(model_dir, staleness=1)
    make_trainer([], max_steps=1).fit(m)
    data = m.rollout()
    seen = []
    monkeypatch.setattr(grpo, "policy_loss", lambda stab, pb: (seen.append(pb), (pb.logp.sum(), {}))[1])
    m.policy_loss(data)
    (pb,) = seen
    G = m.rollout_cfg.group  # rows are prompt-major: row i holds a sample of prompt i // G (VCPO's baseline groups)
    assert pb.group.tolist() == [i // G for i in range(m.rollout_cfg.prompts * G)]
    rows = torch.tensor([0, 5, pb.logp.shape[0] - 1])
    assert torch.allclose(pb.row_logp(rows), pb.logp[rows], rtol=1e-4, atol=1e-5)
    params = [p for p in m.parameters() if p.requires_grad]
    recomputed = recomputed_grad_sq_norms(pb.row_logp, pb.mask, params, rows)
    through_batch = per_sequence_grad_sq_norms(pb.logp.sum(-1), params, rows)
    assert (through_batch[rows] > 0).all()
    assert recomputed.tolist() == pytest.approx(through_batch.tolist(), rel=1e-3)


def test_the_engine_mismatch_kl_is_the_engines_log_prob_less_the_trainers(model_dir):
    """is/engine_mismatch_kl = E[log p_engine - log p_trainer] over the response tokens: +0.1 with every engine
    log-prob 0.1 above the trainer's behaviour log-prob (an engine equal to the trainer gives 0, whatever the
    sign convention)."""
    m = module(model_dir, staleness=1)
    make_trainer([], max_steps=1).fit(m)
    data = m.rollout()
    mask = data["packed"]["mask"]
    data["engine_logp"] = (data["logp_behav"] + 0.1) * mask
    _, metrics = m.policy_loss(data)
    assert float(metrics["is/engine_mismatch_kl"]) == pytest.approx(0.1, abs=1e-6)


def test_the_packed_mask_covers_each_completion_token():
    """_pack: the mask over completion tokens sums to each completion's length (end token included)."""
    from types import SimpleNamespace

    fake = SimpleNamespace(tok=SimpleNamespace(pad_token_id=0), device="cpu")
    rollouts = [SimpleNamespace(prompt_ids=[5, 6, 7], completion_ids=[8, 9, 2]),
                SimpleNamespace(prompt_ids=[5], completion_ids=[4])]
    assert GRPOModule._pack(fake, rollouts)["mask"].sum(-1).tolist() == [3, 1]


def test_policy_reward_is_the_current_versions_mean_with_its_sampling_error(model_dir, monkeypatch):
    """eval/policy_reward at the eval points (before the first update, every 3 steps and the end) is the mean
    reward of the engine's samples of the held-out prompts at that version, with the sampling standard error
    sqrt(sum_i var_i / n) / P."""
    from gacbench.llm.grpo import POLICY_EVAL_SEED
    from gacbench.rollout.engines import Rollout

    m = module(model_dir, staleness=2, steps=7, policy_eval={"prompts": 3, "samples": 4, "every": 3})
    trainer = make_trainer([], max_steps=7)
    calls = []
    real = None

    def generate(prompts, n, max_tokens, seed):
        if seed != POLICY_EVAL_SEED:
            return real(prompts, n, max_tokens, seed)
        calls.append((m.engine.version, len(prompts), n))
        # prompt i: the first i + 1 samples answer right, the rest write nothing
        problems = m.task.batch("eval", 0, len(prompts))
        right = [m.tok.encode(p.answer, add_special_tokens=False) for p in problems]
        return [[Rollout(list(pr), right[i] if j <= i else [], [], m.engine.version) for j in range(n)]
                for i, pr in enumerate(prompts)]

    orig_start = m.on_train_start

    def on_train_start():
        nonlocal real
        orig_start()
        real = m.engine.generate
        monkeypatch.setattr(m.engine, "generate", generate)

    monkeypatch.setattr(m, "on_train_start", on_train_start)
    trainer.fit(m)
    assert [c[0] for c in calls] == [0, 3, 6, 7] and all(c[1:] == (3, 4) for c in calls)
    # rewards per prompt: 1/4, 2/4, 3/4 right -> mean 0.5; variances (n - 1 denominators): 1/4, 1/3, 1/4
    se = ((0.25 + 1 / 3 + 0.25) / 4) ** 0.5 / 3
    assert trainer.logger.values("eval/policy_reward") == pytest.approx([0.5] * 4)
    assert trainer.logger.values("eval/policy_reward_se") == pytest.approx([se] * 4)
    assert trainer.logger.values("eval/policy_version") == [0.0, 3.0, 6.0, 7.0]


def test_policy_eval_settings_are_checked():
    from gacbench.llm.grpo import GRPOModule as M

    with pytest.raises(ValueError, match="policy_eval.samples"):
        M.check_settings({"policy_eval": {"prompts": 4, "samples": 0}})
    with pytest.raises(ValueError, match="unknown policy_eval"):
        M.check_settings({"policy_eval": {"prompt": 4}})
    with pytest.raises(ValueError, match="rollout.mode async"):
        M.check_settings({"policy_eval": {"prompts": 4}, "rollout": {"mode": "async"}, "staleness": 2})


def test_the_policy_batch_carries_each_sequences_lag(model_dir, monkeypatch):
    import gacbench.llm.grpo as grpo

    m = module(model_dir, staleness=1)
    make_trainer([], max_steps=1).fit(m)
    data = m.rollout()
    seen = []
    monkeypatch.setattr(grpo, "policy_loss", lambda stab, pb: (seen.append(pb), (pb.logp.sum(), {}))[1])
    B = data["packed"]["mask"].shape[0]
    m.policy_loss(data, 3)  # the stale queue's lag, for every sequence
    assert seen[-1].lag.tolist() == [3.0] * B
    m.policy_loss(data)
    assert seen[-1].lag is None
    # an asynchronous batch's own lags win over the step's
    lags = GRPOModule._batch_lag({"sample_lag": torch.arange(B)}, 3, B, "cpu")
    assert lags.tolist() == [float(i) for i in range(B)]


def test_a_reward_that_returns_an_int_or_a_bool_trains_as_its_float(model_dir):
    """A reward written as ``int(c == a)`` or ``c == a`` gives the same rewards and advantages as ``float(c == a)``."""
    from gacbench.rollout.engines import Rollout

    m = module(model_dir, group=2)
    problems = m.task.batch("train", 0, 1)
    groups = [[Rollout([1], [5], [-0.1], 0), Rollout([1], [6], [-0.2], 0)]]
    answer = m.reward  # each kind compares a completion's text with the first completion's
    first = None
    out = []
    for kind in (float, int, bool):
        def reward(text, gold, kind=kind):
            nonlocal first
            first = text if first is None else first
            return kind(text == first)

        m.reward = reward
        data = m.batch_from_groups(problems, groups)
        assert data["rewards"].dtype == torch.float32
        out.append((data["rewards"].tolist(), data["adv"].tolist()))
        first = None
    m.reward = answer
    assert out[0] == out[1] == out[2] and out[0][0] == [[1.0, 0.0]]


def test_a_reward_that_is_not_a_finite_number_is_refused_where_it_is_scored(model_dir):
    """A NaN or a None from a reward is named with the completion and the answer when the batch is built, before it
    reaches the advantages, the loss and the weights."""
    from gacbench.rollout.engines import Rollout

    m = module(model_dir, group=2)
    problems = m.task.batch("train", 0, 1)
    groups = [[Rollout([1], [5], [-0.1], 0), Rollout([1], [6], [-0.2], 0)]]
    kept = m.reward
    for bad, shown in ((math.nan, "nan"), (None, "None"), ("1.0x", "'1.0x'")):
        m.reward = lambda text, gold, bad=bad: bad
        with pytest.raises(ValueError, match=rf"returned {re.escape(shown)} for the completion .* \(answer "
                                             rf"'{re.escape(problems[0].answer)}'\); a reward must return a finite"):
            m.batch_from_groups(problems, groups)
    m.reward = kept


def test_the_greedy_eval_ends_and_samples_as_the_engines_do(model_dir):
    """eval/acc's greedy completions end at every end token of the checkpoint's generation config (as the rollout
    engines do), and the checkpoint's sampling settings do not change them."""
    from gacbench.llm.model import load
    from gacbench.llm.task import ArithmeticTask, final_line_reward
    from gacbench.llm.warmstart import greedy_accuracy
    from gacbench.rollout.engines import HFEngine

    model, tok = load(str(model_dir))
    with torch.no_grad():  # the model now ends its answers with <bos> (id 1) where it wrote <eos> (id 2)
        for w in {id(p): p for p in (model.get_input_embeddings().weight,
                                     model.get_output_embeddings().weight)}.values():
            w[[1, 2]] = w[[2, 1]].clone()
    model.generation_config.eos_token_id = [2, 1]
    problems = ArithmeticTask(seed=0).batch("eval", 0, 32)
    seen = []

    def reward(text, answer):
        seen.append(text)
        return final_line_reward(text, answer)

    acc = greedy_accuracy(model, tok, problems, max_tokens=6, reward=reward)
    bos = tok.convert_ids_to_tokens(1)
    assert not any(bos in text for text in seen), seen[:4]  # nothing after the end token is scored
    assert HFEngine(model, tok.eos_token_id, tok.pad_token_id).eos_ids == [2, 1]
    assert acc == sum(final_line_reward(t, p.answer) for t, p in zip(seen, problems)) / len(problems)
    model.generation_config.repetition_penalty = 1.5  # a checkpoint's sampling setting: not applied
    again = []
    greedy_accuracy(model, tok, problems, max_tokens=6, reward=lambda t, a: again.append(t) or 0.0)
    assert again == seen


def test_the_evaluations_of_a_resumed_step_run_once():
    """evaluate_resumed_step runs the missing evaluations of the checkpoint's step once: the command calls it again
    after a fit that had no step left, which must then do nothing."""
    from types import SimpleNamespace

    calls = []
    m = SimpleNamespace(resume_logged=frozenset({"eval/acc"}), resume_max_steps=None, global_step=4,
                        policy_eval_cfg=SimpleNamespace(prompts=0), engine=None, rollout_source=None,
                        _evaluate=lambda **kw: calls.append(kw))
    GRPOModule.evaluate_resumed_step(m)
    GRPOModule.evaluate_resumed_step(m)
    assert calls == [{"missing_from": frozenset({"eval/acc"}), "last": None}] and m.resume_logged is None


@pytest.mark.parametrize("step,max_steps,last,due", [(5, 5, None, True), (3, 10, 3, True), (3, 10, None, False),
                                                     (4, 10, None, True)])
def test_the_policy_evaluation_is_due_at_its_period_and_at_the_last_step(step, max_steps, last, due):
    """policy_eval every 2 steps: due at step 4, and at the run's last step off the period (5 of 5); a resumed
    session re-running the evaluations of a checkpoint that was the last step of the session that wrote it
    (``last``: its max_steps) finds it due there, not at step 3 of a 10-step session."""
    from types import SimpleNamespace

    calls = []
    m = SimpleNamespace(trainer=SimpleNamespace(global_step=step, max_steps=max_steps), metric_name="acc",
                        evaluate_metric=lambda last: None, eval_every=2,
                        policy_eval_cfg=SimpleNamespace(prompts=4, every=2),
                        policy_reward=lambda: {"eval/policy_reward": 0.5}, log_scalars=calls.append)
    GRPOModule._evaluate(m, last=last)
    assert calls == ([{"eval/policy_reward": 0.5}] if due else [])
