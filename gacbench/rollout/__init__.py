"""Where rollouts come from and wait: the stale-rollout queue, the rollout engines (registry) and the
advantage estimators (registry). Shared by every rollout objective (the bandit, GRPO)."""
