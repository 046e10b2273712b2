"""The synthetic objectives' constants and data: the quadratic's spectrum, logistic regression's curvature bound
(its Hessian at 0), the MLP's held-out test set, and the prompts the stale bandit's pipeline fill draws."""

import pytest
import torch
from conftest import make_trainer

from gacbench.objectives import LogisticRegression, MLPClassifier, NoisyQuadratic


# NoisyQuadratic's spectrum from mu = L / kappa to L
def test_the_quadratics_eigenvalues_run_from_l_over_kappa_to_l():
    m = NoisyQuadratic(dim=3, L=4.0, kappa=4.0)  # log-spaced 1, 2, 4
    assert m.eigs.tolist() == pytest.approx([1.0, 2.0, 4.0], rel=1e-6)
    assert (m.mu, m.L) == (1.0, 4.0)


# LogisticRegression's L is the Hessian's largest eigenvalue at w = 0
def test_logistic_L_is_the_hessians_top_eigenvalue_at_zero():
    """softplus''(0) = 1/4, so at w = 0 the Hessian of the model's objective is X^T X / (4 n) + l2 I exactly, and its
    top eigenvalue is the documented L = lambda_max(X^T X / n) / 4 + l2 (the curvature bound everywhere)."""
    m = LogisticRegression(n=64, dim=5, l2=0.1, seed=0)
    m.forward = m.objective  # so that functional_call evaluates the model's own objective at a given w
    x, y = m.x.double(), m.y.double()
    h = torch.autograd.functional.hessian(
        lambda w: torch.func.functional_call(m, {"w": w}, (x, y)), torch.zeros(5, dtype=torch.float64))
    assert float(torch.linalg.eigvalsh(h).max()) == pytest.approx(m.L, rel=1e-5)
    assert float(torch.linalg.eigvalsh(h).min()) >= 0.1 - 1e-9  # mu = l2


# MLPClassifier's test set is held out
def test_the_mlp_metric_is_on_a_held_out_set():
    m = MLPClassifier(n=64, n_test=32, dim=4)
    assert m.x_test.shape == (32, 4) and m.y_test.shape == (32,)
    train = {tuple(r) for r in m.x.tolist()}
    assert not any(tuple(r) in train for r in m.x_test.tolist())


# the bandit's pipeline fill draws each future step's own prompts
def test_the_bandits_pipeline_fill_draws_the_prompts_of_steps_1_to_s():
    """staleness 2: at t = 0 the queue (rollout/queue.py step) pushes produce(1), produce(2), produce(0), all of version
    0, and pops the oldest; produce(k) draws the prompts of step k. So steps 0, 1 consume prompt_ids[1], prompt_ids[2]
    (the fill), and step t >= 2 the batch produced at step t - 2 with prompt_ids[t - 2]; lag min(t, 2). A fill that
    drew step t's prompts for every k would train the first s steps on one set of contexts."""
    from gacbench.objectives import SoftmaxBandit

    m = SoftmaxBandit(staleness=2, steps=6, prompts=4, seed=0)
    seen, real = [], m.queue.step

    def spy(t, produce):
        data, lag = real(t, produce)
        seen.append((t, data["ctx"].clone(), lag))
        return data, lag

    m.queue.step = spy
    make_trainer([], max_steps=6).fit(m)
    assert [t for t, _, _ in seen] == list(range(6))
    for t, ctx, lag in seen:
        assert torch.equal(ctx, m.prompt_ids[t + 1 if t < 2 else t - 2]) and lag == min(t, 2)
