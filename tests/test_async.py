"""rollout.mode: async (Ray rollout workers with the hf engine, the tiny test model): the staleness bound under
both admission rules, per-sample versions, agreement with the synchronous module at s_max = 0, kill and resume,
dead workers, bad settings."""

import logging
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")
pytest.importorskip("ray")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from conftest import TINY_TASK, assert_this_provenance, make_trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from gacbench.llm.grpo import GRPOModule  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`",
                                        "ignore:You're resuming from a checkpoint")


def module(model_dir, steps=8, **rollout):
    settings = {"prompts": 4, "group": 4, "max_tokens": 4, "mode": "async", **rollout}
    if settings["mode"] == "sync":
        settings = {k: v for k, v in settings.items() if k in ("prompts", "group", "max_tokens", "mode")}
    return GRPOModule(model={"path": model_dir}, engine={"name": "hf"}, task=dict(TINY_TASK), rollout=settings,
                      lr=3e-4, steps=steps, eval_every=10**6)


class SlowTrainer(pl.Callback):
    """Holds each step back, so that the rollout worker runs ahead as far as its admission rule lets it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)


class Consumed(pl.Callback):
    """Records what each step consumed: the per-sample versions and lags, and the token ids."""

    def __init__(self) -> None:
        self.rows = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        original = pl_module.policy_loss

        def spy(data, *args):
            self.rows.append({"step": trainer.global_step,
                              "versions": data["versions"].tolist() if "versions" in data else None,
                              "lag": data["sample_lag"].tolist() if "sample_lag" in data else None,
                              "ids": data["packed"]["ids"].clone(), "rewards": data["rewards"].clone()})
            return original(data, *args)

        pl_module.policy_loss = spy

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        del pl_module.policy_loss  # back to the class's method


@pytest.mark.parametrize("admission", ["wait", "drop"])
def test_every_consumed_sample_is_within_max_staleness(tiny_llm_dir, admission):
    s_max, steps = 1, 8
    # drop: three steps handed out ahead of a slow trainer, so that rollouts come back too old and are dropped
    m = module(tiny_llm_dir, steps=steps, max_staleness=s_max, admission=admission, chunks=2,
               buffer=3 if admission == "drop" else None)
    seen = Consumed()
    trainer = make_trainer([seen, SlowTrainer(0.25)], max_steps=steps)
    trainer.fit(m)
    assert trainer.global_step == steps
    assert [r["step"] for r in seen.rows] == list(range(steps))
    for row in seen.rows:  # every sample carries the version that generated it, inside [t - s_max, t]
        t = row["step"]
        assert len(row["versions"]) == 4 * 4
        assert all(max(0, t - s_max) <= v <= t for v in row["versions"])
        assert row["lag"] == [t - v for v in row["versions"]]
    lags = trainer.logger.values("stale/lag_max")
    assert max(lags) == s_max  # the worker ran ahead to the bound, never past it
    summary = m.source_summary
    assert summary["lag_max"] <= s_max and sum(summary["lag_hist"]) == steps * 16
    consumed = m.rollout_source.producer.consumed
    assert [(c["step"], c["chunk"]) for c in consumed] == [(t, c) for t in range(steps) for c in range(2)]
    dropped = trainer.logger.values("async/dropped")
    if admission == "wait":
        assert summary["dropped"] == 0 and sum(dropped) == 0
        assert all(c["attempt"] == 0 for c in consumed)
    else:
        assert summary["dropped"] > 0  # counted, per step and in total, and logged as events
        assert sum(dropped) == trainer.logger.values("async/dropped_total")[-1] == summary["dropped"]
        assert sum("dropped the rollouts of step" in e for e in summary["events"]) == summary["dropped"]
        assert any(c["attempt"] == 1 for c in consumed)  # regenerated, then consumed within the bound


def test_async_at_max_staleness_0_samples_what_the_synchronous_module_samples(tiny_llm_dir):
    """One chunk at s_max = 0 under 'wait': each step's rollouts come from the current weights with the seed of
    the synchronous module, so both consume the same tokens and rewards (the behaviour log-probs differ only by
    the engine-vs-trainer gap, below 1e-5)."""
    runs = {}
    for mode in ("sync", "async"):
        m = module(tiny_llm_dir, steps=4, mode=mode, max_staleness=0) if mode == "async" else \
            module(tiny_llm_dir, steps=4, mode="sync")
        seen = Consumed()
        trainer = make_trainer([seen], max_steps=4)
        trainer.fit(m)
        runs[mode] = (seen.rows, trainer.logger, m)
    (rows_s, _, m_s), (rows_a, log_a, m_a) = runs["sync"], runs["async"]
    assert log_a.values("stale/lag") == [0.0] * 4
    for a, b in zip(rows_s, rows_a):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["rewards"], b["rewards"])
    assert max(abs(x) for x in log_a.values("is/engine_mismatch_kl")) < 1e-5  # lag 0: the engine's gap alone
    for p, q in zip(m_s.policy.parameters(), m_a.policy.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0)


class CrashAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated crash")


def test_a_crashed_async_run_resumes_without_losing_a_step_and_counts_the_regenerated_rollouts(
        tiny_llm_dir, tmp_path, caplog):
    first = module(tiny_llm_dir, steps=8, max_staleness=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        make_trainer([ckpt, CrashAt(5), SlowTrainer(0.1)], max_steps=8, enable_checkpointing=True).fit(first)
    assert first.rollout_source.producer.closed  # the failed fit stopped its workers
    saved = torch.load(next(tmp_path.glob("*step=3.ckpt")), weights_only=False)["rollout_source"]
    assert saved["unconsumed"] > 0  # rollouts of steps 3.. were generated or in flight when it was written

    resumed = module(tiny_llm_dir, steps=8, max_staleness=2)
    seen = Consumed()
    trainer = make_trainer([seen], max_steps=8)
    with caplog.at_level(logging.WARNING, logger="gacbench.async"):
        trainer.fit(resumed, ckpt_path=next(tmp_path.glob("*step=3.ckpt")))
    assert trainer.global_step == 8
    assert [r["step"] for r in seen.rows] == [3, 4, 5, 6, 7]  # no optimizer step lost or repeated
    assert [c["step"] for c in resumed.rollout_source.producer.consumed] == [3, 4, 5, 6, 7]
    assert trainer.logger.values("async/resume_regenerated") == [saved["unconsumed"]]
    assert resumed.source_summary["resume_regenerated"] == saved["unconsumed"]
    assert resumed.source_summary["regenerated"] >= saved["unconsumed"]
    assert any("discarded and generated again" in r.getMessage() for r in caplog.records)
    for row in seen.rows:
        assert all(row["step"] - 2 <= v <= row["step"] for v in row["versions"])


class BehaviourIsEngine(pl.Callback):
    """Records, per step, whether the batch's behaviour log-probs are the engine's own (async mode)."""

    def __init__(self) -> None:
        self.same = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        original = pl_module.policy_loss

        def spy(data, *args):
            self.same.append(torch.equal(data["logp_behav"], data["engine_logp"]))
            return original(data, *args)

        pl_module.policy_loss = spy

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        del pl_module.policy_loss


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_a_resumed_async_run_keeps_the_counters_of_the_run_before_its_checkpoint(tiny_llm_dir, tmp_path):
    first = module(tiny_llm_dir, steps=4, max_staleness=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    make_trainer([ckpt], max_steps=4, enable_checkpointing=True).fit(first)
    path = next(tmp_path.glob("*step=2.ckpt"))
    state = torch.load(path, weights_only=False)
    earlier = {"dropped": 5, "restart_regenerated": 3, "restarts": 2, "resume_regenerated": 1}
    state["rollout_source"]["counters"].update(earlier)  # as if the run before the checkpoint had drops and restarts
    torch.save(state, path)
    unconsumed = state["rollout_source"]["unconsumed"]

    resumed = module(tiny_llm_dir, steps=4, max_staleness=1)
    again = ModelCheckpoint(dirpath=tmp_path / "resumed", every_n_train_steps=2, save_top_k=-1)
    behaviour = BehaviourIsEngine()
    trainer = make_trainer([again, behaviour], max_steps=4, enable_checkpointing=True)
    trainer.fit(resumed, ckpt_path=path)
    assert trainer.global_step == 4 and behaviour.same == [True, True]  # async: pi_behav is the engine's
    summary = resumed.source_summary  # this session: admission wait, no drops, no restarts
    assert summary["dropped"] == 5 and summary["worker_restarts"] == 2
    assert summary["regenerated"] == 5 + 3 + 1 + unconsumed and summary["resume_regenerated"] == unconsumed
    log = trainer.logger
    assert log.values("async/dropped_total") == [5.0, 5.0] and log.values("async/worker_restarts") == [2.0, 2.0]
    assert log.values("async/regenerated_total") == [9.0 + unconsumed] * 2
    saved = torch.load(next((tmp_path / "resumed").glob("*step=4.ckpt")), weights_only=False)["rollout_source"]
    assert {k: saved["counters"][k] for k in earlier} == {**earlier, "resume_regenerated": 1 + unconsumed}
    assert saved["counters"]["consumed"] == state["rollout_source"]["counters"]["consumed"] + 2


class KillWorkerAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            pl_module.rollout_source.producer.kill_worker(0)


def test_a_dead_rollout_worker_stops_the_run_with_the_fix(tiny_llm_dir):
    m = module(tiny_llm_dir, steps=6, max_staleness=1)
    with pytest.raises(RuntimeError, match=r"rollout worker 0 \(pid \d+\) died holding step \d+ chunk \d+.*"
                                           r"resume from the last checkpoint.*worker_restarts > 0"):
        make_trainer([KillWorkerAt(2)], max_steps=6).fit(m)
    assert m.rollout_source.producer.closed


def test_a_dead_rollout_worker_is_restarted_and_that_is_logged(tiny_llm_dir, caplog):
    m = module(tiny_llm_dir, steps=6, max_staleness=1, worker_restarts=1)
    trainer = make_trainer([KillWorkerAt(2)], max_steps=6)
    with caplog.at_level(logging.WARNING, logger="gacbench.async"):
        trainer.fit(m)
    assert trainer.global_step == 6
    assert trainer.logger.values("async/worker_restarts")[-1] == 1.0
    summary = m.source_summary
    assert summary["worker_restarts"] == 1 and summary["regenerated"] >= 1
    assert any("restarting it" in r.getMessage() for r in caplog.records)
    assert [c["step"] for c in m.rollout_source.producer.consumed] == list(range(6))


def test_a_worker_that_dies_holding_two_jobs_is_restarted_and_both_are_generated_again(tiny_llm_dir):
    import functools

    from gacbench.llm.async_source import _load_policy
    from gacbench.llm.model import load
    from gacbench.rollout.async_producer import AsyncRolloutProducer
    from gacbench.rollout.engines import EngineSpec

    policy, tok = load(tiny_llm_dir)
    prompt = tok.encode("1+2=", add_special_tokens=False)
    producer = AsyncRolloutProducer(
        EngineSpec("hf"), model_path=tiny_llm_dir, policy_factory=functools.partial(_load_policy, tiny_llm_dir),
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_model_len=None, seed=0,
        prompts_for=lambda step, chunk: [prompt] * 2, n=2, max_tokens=4, chunks=1, last_step=4, max_staleness=3,
        admission="wait", workers=1, worker_restarts=1, timeout_s=120)
    try:
        producer.start(policy.state_dict(), version=0)
        with producer._cv:  # the worker is still starting: both of its slots hold a job
            held = sorted(job.step for job, _ in producer._inflight.values())
            producer.kill_worker(0)
        assert held == [0, 1]
        attempts = []
        for step in range(4):
            attempts.append([r.attempt for r in producer.next(step)])
            producer.publish(policy.state_dict(), step + 1)
        assert (producer.counters.restarts, producer.counters.restart_regenerated) == (1, 2)
        assert attempts[0] == attempts[1] == [1]  # the two lost jobs, generated again by the restarted worker
    finally:
        producer.close()


def test_bad_async_settings_are_refused(tiny_llm_dir):
    with pytest.raises(ValueError, match="rollout.mode='fast' is not one of sync, async"):
        module(tiny_llm_dir, mode="fast")
    with pytest.raises(ValueError, match="rollout.max_staleness is the bound of rollout.mode 'async'"):
        GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, rollout={"max_staleness": 2})
    with pytest.raises(ValueError, match="admission 'drop' needs max_staleness >= 1"):
        module(tiny_llm_dir, max_staleness=0, admission="drop")
    with pytest.raises(ValueError, match="rollout.admission='later' is not one of wait, drop"):
        module(tiny_llm_dir, max_staleness=1, admission="later")
    with pytest.raises(ValueError, match="rollout.prompts=4 is not a multiple of rollout.chunks=3"):
        module(tiny_llm_dir, max_staleness=1, chunks=3)
    with pytest.raises(ValueError, match="staleness=2 and rollout.max_staleness=3 disagree"):
        GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, staleness=2,
                   rollout={"mode": "async", "max_staleness": 3})
    m = GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, staleness=3, rollout={"mode": "async"})
    assert m.staleness == 3 and m.queue.staleness == 3  # the module's staleness is the bound without max_staleness


def test_a_checkpoint_of_the_other_mode_is_refused(tiny_llm_dir):
    sync_module = module(tiny_llm_dir, mode="sync")
    with pytest.raises(ValueError, match="written by a run with rollout.mode: async; resume it with that mode"):
        sync_module.on_load_checkpoint({"rollout_source": {"mode": "async", "unconsumed": 0}, "rollout_queue": {}})
    async_module = module(tiny_llm_dir, max_staleness=2)
    with pytest.raises(ValueError, match="written by a synchronous run with batches waiting"):
        async_module.on_load_checkpoint({"rollout_queue": {"staleness": 2, "items": [(0, {})]},
                                         "grpo_rollouts_made": 3})


def test_the_uniform_lag_simulator_at_a_single_lag_is_the_fixed_lag_fifo(tiny_llm_dir):
    """rollout.mode uniform with min_staleness = max_staleness = s generates each step's prompts with the weights of
    version max(0, t - s) and the synchronous seed: the same tokens as the stale FIFO at staleness s."""
    runs = {}
    for mode in ("sync", "uniform"):
        m = GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, task=dict(TINY_TASK), staleness=2,
                       rollout={"prompts": 4, "group": 4, "max_tokens": 4, "mode": mode,
                                **({"min_staleness": 2} if mode == "uniform" else {})},
                       lr=3e-3, steps=6, eval_every=10**6)
        seen = Consumed()
        trainer = make_trainer([seen], max_steps=6)
        trainer.fit(m)
        runs[mode] = (seen.rows, trainer.logger.values("stale/lag"), m)
    (rows_f, lag_f, m_f), (rows_u, lag_u, m_u) = runs["sync"], runs["uniform"]
    assert lag_f == lag_u == [0, 1, 2, 2, 2, 2]
    for a, b in zip(rows_f, rows_u):
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["rewards"], b["rewards"])
    for row in rows_u:
        assert set(row["versions"]) == {max(0, row["step"] - 2)}
    for p, q in zip(m_f.policy.parameters(), m_u.policy.parameters()):  # behaviour log-probs: trainer's vs engine's
        torch.testing.assert_close(p, q, atol=1e-4, rtol=0)  # (1e-7 apart), through Adam's normalisation at lr 3e-3


def test_the_policy_reward_under_the_uniform_lag_simulator_is_the_current_versions(tiny_llm_dir, monkeypatch):
    """Under rollout.mode uniform the engine holds the version its last rollout drew; the policy evaluation loads the
    current weights first: it measures the versions it names, and θ_0's reward is the synchronous run's, draw for
    draw (the same weights, prompts and seed)."""
    loads = []
    load_engine = GRPOModule.load_engine

    def recorded(self, version):
        loads.append((version, self.global_step, self.rollout_source is not None))
        return load_engine(self, version)

    monkeypatch.setattr(GRPOModule, "load_engine", recorded)
    rewards = {}
    for mode in ("sync", "uniform"):
        loads.clear()
        m = GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, task=dict(TINY_TASK), staleness=2,
                       rollout={"prompts": 4, "group": 4, "max_tokens": 4, "mode": mode,
                                **({"min_staleness": 1} if mode == "uniform" else {})},
                       policy_eval={"prompts": 4, "samples": 4, "every": 2}, lr=3e-3, steps=5, eval_every=10**6)
        trainer = make_trainer([], max_steps=5)
        trainer.fit(m)
        assert trainer.logger.values("eval/policy_version") == [0.0, 2.0, 4.0, 5.0]
        rewards[mode] = trainer.logger.values("eval/policy_reward")
        if mode == "uniform":  # the simulator publishes the rollouts' weights: every load is an evaluation's θ_t
            assert loads == [(t, t, True) for t in (0, 2, 4, 5)]
        else:  # the trainer's own sync after each step
            assert [v for v, *_ in loads] == list(range(6)) and not any(src for *_, src in loads)
    assert rewards["uniform"][0] == rewards["sync"][0]


def test_the_uniform_lag_simulator_draws_seeded_lags_within_its_range(tiny_llm_dir):
    lags = []
    for _ in range(2):
        m = GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, task=dict(TINY_TASK),
                       rollout={"prompts": 4, "group": 4, "max_tokens": 4, "mode": "uniform", "max_staleness": 3,
                                "min_staleness": 1}, lr=3e-4, steps=12, eval_every=10**6)
        seen = Consumed()
        trainer = make_trainer([seen], max_steps=12)
        trainer.fit(m)
        lags.append(trainer.logger.values("stale/lag"))
        for row, lag in zip(seen.rows, lags[-1]):
            t = row["step"]
            assert min(1, t) <= lag <= min(3, t)  # drawn from min_staleness..min(s, t)
            assert set(row["versions"]) == {t - lag}
        hist = m.source_summary["lag_hist"]  # samples per lag: 12 steps x 16 samples
        assert sum(hist) == 12 * 16 and hist == [16 * lags[-1].count(k) for k in range(len(hist))]
    assert lags[0] == lags[1]  # seeded
    assert len(set(lags[0][3:])) > 1  # it varies
    with pytest.raises(ValueError, match="rollout.min_staleness=4 must lie in 0..3"):
        GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "hf"}, staleness=3,
                   rollout={"mode": "uniform", "min_staleness": 4})


def test_a_step_below_the_smallest_lag_draws_the_largest_lag_it_can_have():
    """min_staleness 3, max 4: steps 0-2 cannot be 3 stale, so each draws lag t (its oldest reachable version),
    never a smaller one; from step 3 on, 3 or 4 (both drawn over 200 draws from step 4 on)."""
    from types import SimpleNamespace

    from gacbench.llm.lag_schedule import UniformLagSource

    src = UniformLagSource(SimpleNamespace(rollout_cfg=SimpleNamespace(min_staleness=3), staleness=4, seed=0))
    drawn = {t: {src.draw(t) for _ in range(200)} for t in range(6)}
    assert drawn == {0: {0}, 1: {1}, 2: {2}, 3: {3}, 4: {3, 4}, 5: {3, 4}}


def test_async_bench_refuses_a_bound_no_step_reaches(capsys):
    from gacbench.cli import main

    assert main(["async-bench", "--steps", "4", "--max-staleness", "4"]) == 2
    assert "--max-staleness 4 is not below --steps 4" in capsys.readouterr().err
    assert main(["async-bench", "--steps", "4", "--max-staleness", "0", "--admission", "drop"]) == 2
    capsys.readouterr()
    assert main(["async-bench", "--task", "nope"]) == 2
    assert "--task 'nope' is not a registered task; registered: " in capsys.readouterr().err
    assert main(["async-bench", "--size", "huge"]) == 2
    assert "--size 'huge' is not a built-in model size; sizes: tiny, small, medium" in capsys.readouterr().err


def test_async_bench_trains_on_the_task_it_is_given():
    from types import SimpleNamespace

    from gacbench.llm.async_bench import run_settings

    args = SimpleNamespace(prompts=8, group=8, max_tokens=48, model="m", engine="hf", lr=1e-3, steps=60, seed=0,
                           eval_size=8, max_staleness=4, admission="wait", workers=1, worker_threads=1,
                           trainer_threads=None)
    assert "task" not in run_settings("sync", SimpleNamespace(**vars(args), task="arithmetic"))  # the module's default
    for mode in ("sync", "async"):
        assert run_settings(mode, SimpleNamespace(**vars(args), task="scratchpad"))["task"] == {"name": "scratchpad"}


def _strict_json(path):
    import json

    return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in {path}"))


def test_async_bench_writes_strict_json(tmp_path, monkeypatch, capsys):
    """A run shorter than the AlignmentMonitor's warm-up has NaN c_t statistics (and a NaN lag mean when nothing
    was consumed): the record and the printed summary hold null there, never a bare NaN."""
    import json

    from gacbench.cli import main
    from gacbench.llm import async_bench

    nan = float("nan")

    def run_one(mode, args, log_dir=None, threads=None):
        rec = {"steps_s": 0.5 if mode == "sync" else 0.4, "startup_s": 1.0, "reward": [0.25], "eval_acc": 0.5,
               "step_s": [0.5], "generate_s": [0.2], "cos": [nan],
               "alignment": {"median": nan, "max_abs": float("inf"), "n": 0}}
        if mode == "async":
            rec["async"] = {"lag_mean": nan, "lag_max": 0, "dropped": 0, "trainer_threads": 1}
        return rec

    monkeypatch.setattr(async_bench, "run_one", run_one)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out = tmp_path / "bench.json"
    assert main(["async-bench", "--steps", "1", "--max-staleness", "0", "--engine", "hf", "--model", str(model),
                 "--sync-threads", "1", "--json", str(out)]) == 0
    rec = _strict_json(out)
    assert rec["lag_mean"] is None and rec["lag_max"] == 0 and rec["speedup"] == pytest.approx(0.5 / 0.4)
    # generation 0.2 s of a 0.5 s step, training the other 0.3 s: a perfect overlap takes max(0.2, 0.3)
    assert rec["ideal_speedup"] == pytest.approx(0.5 / 0.3) and rec["generate_share"] == pytest.approx(0.4)
    assert rec["runs"]["sync"]["alignment"] == {"median": None, "max_abs": None, "n": 0}
    assert rec["runs"]["async"]["cos"] == [None] and rec["sync_reward_final"] == 0.25
    printed = capsys.readouterr().out
    assert "NaN" not in printed and "Infinity" not in printed
    assert json.loads(printed)["lag_mean"] is None


@pytest.mark.slow
def test_async_bench_times_both_modes_and_writes_the_record(tiny_llm_dir, tmp_path):

    from gacbench.cli import main

    out = tmp_path / "bench.json"
    assert main(["async-bench", "--steps", "4", "--max-staleness", "2", "--engine", "hf", "--model", tiny_llm_dir,
                 "--prompts", "2", "--group", "2", "--max-tokens", "4", "--eval-size", "4", "--sync-threads", "1",
                 "--json", str(out)]) == 0
    rec = _strict_json(out)  # 4 steps, below the monitor's warm-up of 5: its statistics are null, not NaN
    assert rec["runs"]["async"]["alignment"]["median"] is None
    assert rec["speedup"] == pytest.approx(rec["sync_s"] / rec["async_s"])
    assert rec["sync_s"] > 0 and rec["async_s"] > 0 and rec["max_staleness"] == 2
    assert 0 <= rec["lag_mean"] <= rec["lag_max"] <= 2 and rec["dropped"] == 0
    assert len(rec["runs"]["sync"]["reward"]) == len(rec["runs"]["async"]["reward"]) == 4
    assert all(0 <= lag <= 2 for lag in rec["runs"]["async"]["lag"])
    assert {"sync_reward_final", "async_reward_final"} <= set(rec)
    assert_this_provenance(rec)


@pytest.mark.slow
def test_a_vllm_rollout_worker_verifies_its_weight_sync(tiny_llm_dir):
    pytest.importorskip("vllm")
    m = GRPOModule(model={"path": tiny_llm_dir}, engine={"name": "vllm"}, task=dict(TINY_TASK),
                   rollout={"prompts": 4, "group": 4, "max_tokens": 4, "mode": "async", "max_staleness": 1},
                   lr=3e-3, steps=4, eval_every=10**6)
    trainer = make_trainer([SlowTrainer(0.1)], max_steps=4)
    trainer.fit(m)
    summary = m.source_summary
    assert len(summary["sync_checks"]) == 1 and summary["sync_checks"][0] < 1e-3  # after the first new weights
    assert summary["lag_max"] <= 1 and trainer.global_step == 4


# async_source.trainer_threads
def test_trainer_threads_are_the_cores_the_workers_leave(monkeypatch):
    from gacbench.llm import async_source

    monkeypatch.setattr(async_source.os, "cpu_count", lambda: 16)
    cfg = SimpleNamespace(trainer_threads=None, workers=2, worker_threads=3)
    assert async_source.trainer_threads(cfg) == 16 - 2 * 3
    assert async_source.trainer_threads(SimpleNamespace(trainer_threads=None, workers=4, worker_threads=8)) == 1
    assert async_source.trainer_threads(SimpleNamespace(trainer_threads=5, workers=4, worker_threads=8)) == 5


# AsyncGRPOSource.summary's lag statistics
def test_the_async_summary_lag_mean_is_per_sample():
    from gacbench.llm.async_source import AsyncGRPOSource

    src = object.__new__(AsyncGRPOSource)
    counters = SimpleNamespace(dropped=0, restart_regenerated=0, restarts=0, resume_regenerated=0, waited_s=0.0,
                               worker_gen_s=0.0, worker_wait_s=0.0, worker_load_s=0.0)
    src.producer = SimpleNamespace(counters=counters, worker_pids=lambda: [], sync_checks=[], events=[])
    src.cfg = SimpleNamespace(admission="wait", workers=1, worker_threads=1, trainer_threads=1)
    src.s_max, src.earlier, src.resume_regenerated = 2, {}, 0
    src.lag_counts = [3, 1, 0]  # 3 samples at lag 0, 1 at lag 1
    out = src.summary()
    assert out["lag_mean"] == pytest.approx(0.25) and (out["lag_min"], out["lag_max"]) == (0, 1)


# rollout.buffer must be >= 1
def test_an_async_buffer_of_zero_is_refused():
    from gacbench.llm.async_source import resolve_mode

    ok = SimpleNamespace(mode="async", max_staleness=2, min_staleness=0, admission="wait", workers=1, worker_threads=1,
                         chunks=1, worker_restarts=0, trainer_threads=None, prompts=4, buffer=1)
    assert resolve_mode(ok, 0) == 2
    with pytest.raises(ValueError, match=r"rollout.buffer=0 must be >= 1"):
        resolve_mode(SimpleNamespace(**{**vars(ok), "buffer": 0}), 0)


# rollout.workers must be >= 1
def test_async_without_rollout_workers_is_refused():
    from gacbench.llm.async_source import resolve_mode

    cfg = SimpleNamespace(mode="async", max_staleness=2, min_staleness=0, admission="wait", workers=0, worker_threads=1,
                          chunks=1, worker_restarts=0, trainer_threads=None, prompts=4, buffer=None)
    with pytest.raises(ValueError, match=r"rollout.workers=0 must be >= 1"):
        resolve_mode(cfg, 0)
