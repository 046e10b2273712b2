"""The shared stale-rollout queue, the advantage estimators and their registry, and exact resume of the
bandit through the queue."""

import pytest
import torch
from conftest import make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from gacbench.objectives import SoftmaxBandit
from gacbench.rollout import advantages
from gacbench.rollout.advantages import advantage_fn, register_advantage
from gacbench.rollout.queue import StaleRolloutQueue


def test_queue_lags_are_min_t_s_and_versions_stay_in_the_bound():
    q = StaleRolloutQueue(3)
    made = []

    def produce(k):
        made.append((t, k))
        return {"made_at": t, "k": k}

    lags, versions = [], []
    for t in range(8):
        batch, lag = q.step(t, produce)
        lags.append(lag)
        versions.append(batch["made_at"])
        assert t - 3 <= batch["made_at"] <= t
    assert lags == [0, 1, 2, 3, 3, 3, 3, 3]
    assert versions == [0, 0, 0, 0, 1, 2, 3, 4]
    assert made[:4] == [(0, 1), (0, 2), (0, 3), (0, 0)]  # the initial fill, then step 0's own batch
    assert q.versions == [5, 6, 7]


def _consumed(s, steps, last_step, resume_at=None):
    """Run a queue of staleness s for ``steps`` steps with a counting producer (optionally through a state_dict
    round trip at ``resume_at``): (the batches consumed with their lags, the number of batches produced)."""
    q, made, out = StaleRolloutQueue(s), [0], []

    def produce(k):
        made[0] += 1
        return made[0], k  # the producer's n-th call and the queue position asked for: a seeded engine's rollout

    for t in range(steps):
        if t == resume_at:
            fresh = StaleRolloutQueue(s)
            fresh.load_state_dict(q.state_dict())
            q = fresh
        out.append(q.step(t, produce, last_step=last_step))
    return out, made[0]


# runs longer than s, and runs no longer than s (the cut then falls inside the initial fill)
@pytest.mark.parametrize("s,steps", [(0, 5), (1, 2), (3, 8), (5, 6), (16, 40), (32, 100), (1, 1), (3, 3), (4, 2),
                                     (5, 1), (16, 16), (8, 7)])
def test_a_queue_given_the_last_step_produces_no_batch_past_it_and_consumes_the_same_ones(s, steps):
    full, made_full = _consumed(s, steps, None)
    cut, made_cut = _consumed(s, steps, steps - 1)
    assert cut == full  # the same batches (the producer's same call numbers), with the same lags
    assert made_full == steps + s and made_cut == steps
    assert [lag for _, lag in cut] == [min(t, s) for t in range(steps)]
    for at in range(1, steps):  # a resume anywhere, the cut included, consumes the same batches
        assert _consumed(s, steps, steps - 1, resume_at=at) == (full, steps)


def test_a_queue_cut_for_a_run_refuses_to_serve_steps_past_it():
    q = StaleRolloutQueue(3)
    for t in range(6):
        q.step(t, lambda k: t, last_step=5)
    assert len(q) == 0
    with pytest.raises(RuntimeError, match="stopped producing at step 3 .* original number of steps"):
        q.step(6, lambda k: 6, last_step=9)  # a resume asked for more steps than the queue was cut for
    q = StaleRolloutQueue(3)
    for t in range(4):
        q.step(t, lambda k: t, last_step=5)
    r = StaleRolloutQueue(3)
    r.load_state_dict(q.state_dict())
    with pytest.raises(RuntimeError, match="holds 2 batches at step 4, fewer than the 3"):
        r.step(4, lambda k: 4, last_step=9)


def test_queue_refuses_versions_outside_the_bound_and_going_backwards():
    q = StaleRolloutQueue(2)
    q.push("old", version=0)
    with pytest.raises(RuntimeError, match="version 0, step 5 may consume versions 3..5"):
        q.pop(5)
    q.push("newer", version=4)
    with pytest.raises(ValueError, match="never decrease"):
        q.push("older", version=3)
    assert q.pop(2) == ("old", 2)
    with pytest.raises(RuntimeError, match="version 4, step 3"):  # from the future
        q.pop(3)
    with pytest.raises(RuntimeError, match="nothing to consume"):
        StaleRolloutQueue(0).pop(0)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="staleness"):
            StaleRolloutQueue(bad)


def test_queue_state_round_trips_and_refuses_another_staleness():
    q = StaleRolloutQueue(2)
    for t in range(3):
        q.step(t, lambda k: torch.tensor([t, k]))
    r = StaleRolloutQueue(2)
    r.load_state_dict(q.state_dict())
    assert r.versions == q.versions == [1, 2]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(q.state_dict()["items"], r.state_dict()["items"]))
    with pytest.raises(ValueError, match="staleness=2, this run has staleness=3"):
        StaleRolloutQueue(3).load_state_dict(q.state_dict())


def test_loading_a_state_replaces_what_the_queue_holds():
    q = StaleRolloutQueue(2)
    q.push("a", version=3)
    q.push("b", version=4)
    saved = q.state_dict()
    busy = StaleRolloutQueue(2)
    for v, name in ((5, "x"), (6, "y"), (6, "z")):  # batches of later versions already waiting
        busy.push(name, version=v)
    busy.load_state_dict(saved)
    assert len(busy) == 2 and busy.versions == [3, 4]
    assert busy.pop(5) == ("a", 2) and busy.pop(5) == ("b", 1)
    busy.load_state_dict(StaleRolloutQueue(2).state_dict())  # an empty state empties the queue
    assert len(busy) == 0
    busy.load_state_dict(saved)
    q.push("c", version=5)  # the loaded queue holds its own items: the saving queue's later pushes stay apart
    assert busy.versions == [3, 4] and q.versions == [3, 4, 5]


class _Ranks:
    def __init__(self, world_size: int, global_rank: int) -> None:
        self.world_size, self.global_rank = world_size, global_rank


def test_a_queue_checkpointed_across_processes_resumes_only_with_as_many():
    """Each rank's queue holds its own rollouts: a checkpoint holds them by rank, and another number of processes
    cannot share them out."""
    m = SoftmaxBandit(staleness=2, steps=4)
    m.queue.push({"ids": torch.arange(3)}, 0)
    one = m.queue.state_dict()
    m.trainer = _Ranks(1, 0)
    with pytest.raises(ValueError, match="those of 2 processes, this run has 1.*resume with 2 devices"):
        m.on_load_checkpoint({"rollout_queue": {"by_rank": [one, one]}})
    m.trainer = _Ranks(2, 1)
    with pytest.raises(ValueError, match="one process's, this run has 2.*resume with 1 device"):
        m.on_load_checkpoint({"rollout_queue": one})
    other = StaleRolloutQueue(2)
    other.push({"ids": torch.arange(5)}, 1)
    m.on_load_checkpoint({"rollout_queue": {"by_rank": [one, other.state_dict()]}})  # rank 1 takes its own
    assert m.queue.versions == [1] and torch.equal(m.queue.pop(1)[0]["ids"], torch.arange(5))
    # load_from_checkpoint: no trainer, no run to resume; a process's queue is read, a per-rank one left empty
    loose = SoftmaxBandit(staleness=2, steps=4)
    loose.on_load_checkpoint({"rollout_queue": one})
    assert loose.queue.versions == [0]
    loose = SoftmaxBandit(staleness=2, steps=4)
    with pytest.warns(UserWarning, match="queues are those of 2 processes and this module has no trainer"):
        loose.on_load_checkpoint({"rollout_queue": {"by_rank": [one, one]}})
    assert loose.queue.versions == []


def test_advantage_estimators_match_hand_computations():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # group 0: mean 0.5, unbiased std sqrt(1/3); group 1: all equal
    std = (1 / 3) ** 0.5
    grpo = advantage_fn("grpo")(r)
    assert torch.allclose(grpo[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(grpo[1], torch.zeros(4))
    assert torch.equal(advantage_fn("dr-grpo")(r), torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]))
    # RLOO: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3
    assert torch.allclose(advantage_fn("rloo")(r), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, 0.0, 0.0, 0.0]]))
    # population std: sqrt(1/4) = 0.5 over G = 4 (the unbiased one is sqrt(1/3))
    population = advantage_fn("grpo-population")(r)
    assert torch.allclose(population[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (0.5 + 1e-6))
    assert torch.equal(population[1], torch.zeros(4))
    with pytest.raises(ValueError, match="unknown advantage estimator 'gae'.*dr-grpo, grpo, grpo-population, rloo"):
        advantage_fn("gae")
    with pytest.raises(ValueError, match="group >= 2"):
        advantage_fn("grpo")(torch.ones(3, 1))


def test_a_registered_estimator_is_used_by_the_bandit():
    calls = []

    @register_advantage("test-sign")
    def sign(rewards):
        calls.append(rewards.shape)
        return torch.sign(rewards - rewards.mean(-1, keepdim=True))

    try:
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("test-sign")(sign)
        make_trainer([], max_steps=3).fit(SoftmaxBandit(steps=3, prompts=4, group=5, advantage="test-sign"))
        assert calls == [(4, 5)] * 3
    finally:
        advantages.ADVANTAGES.pop("test-sign")


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`", "ignore:You're resuming from a checkpoint")
def test_bandit_resume_in_the_middle_of_a_stale_run_is_exact(tmp_path):
    full = SoftmaxBandit(steps=10, staleness=3, seed=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    t_full = make_trainer([ckpt], max_steps=10, enable_checkpointing=True)
    t_full.fit(full)
    assert t_full.logger.values("stale/lag") == [0, 1, 2, 3, 3, 3, 3, 3, 3, 3]
    resumed = SoftmaxBandit(steps=10, staleness=3, seed=1)
    trainer = make_trainer([], max_steps=10)
    trainer.fit(resumed, ckpt_path=next(tmp_path.glob("*step=4.ckpt")))
    assert trainer.logger.values("stale/lag") == [3] * 6
    assert trainer.logger.values("reward/mean") == t_full.logger.values("reward/mean")[4:]
    assert torch.equal(full.W, resumed.W)
    assert resumed.queue.versions == full.queue.versions == [7, 8, 9]
    with pytest.raises(ValueError, match="staleness=3, this run has staleness=2"):
        make_trainer([], max_steps=10).fit(SoftmaxBandit(steps=10, staleness=2, seed=1),
                                           ckpt_path=next(tmp_path.glob("*step=4.ckpt")))


@pytest.mark.parametrize("name", ["grpo", "grpo-population", "dr-grpo", "rloo"])
def test_a_group_of_equal_fractional_rewards_has_zero_advantage(name):
    # float32 0.7 * 8: the group mean differs from 0.7 in the last bit, and the std is that residue
    rewards = torch.tensor([[0.7] * 8, [0.3] * 8, [0.1] * 8], dtype=torch.float32)
    assert (advantage_fn(name)(rewards) == 0).all()
    mixed = torch.tensor([[0.7, 0.7, 0.7, 0.2], [0.0, 1.0, 1.0, 0.0]])
    out = advantage_fn(name)(mixed)
    assert (out != 0).all() and torch.allclose(out.sum(-1), torch.zeros(2), atol=1e-6)
