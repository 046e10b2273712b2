"""Shared test helpers: a LightningModule written the way a user writes one, and a fit helper."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gacbench.loggers import MemoryLogger

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class UserRegressor(pl.LightningModule):
    """A small MLP regressor with two parameter groups, as a user would write it (nothing gacbench-specific)."""

    def __init__(self, n: int = 64, batch_size: int = 8, lr: float = 0.05, optimizer: str = "sgd", seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)  # the layers' default initialisation
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
        self.x = torch.randn(n, 5, generator=gen)
        self.y = (self.x @ torch.randn(5, 1, generator=gen)).sin()
        self.batch_size, self.lr, self.opt_name = batch_size, lr, optimizer

    def loss_fn(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss_fn(batch)
        self.log("loss", loss, on_step=True, on_epoch=False)
        return loss

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.x, self.y), batch_size=self.batch_size, shuffle=False)

    def configure_optimizers(self):
        groups = [{"params": self.net[0].parameters()}, {"params": self.net[2].parameters(), "lr": self.lr / 2}]
        if self.opt_name == "adamw":
            return torch.optim.AdamW(groups, lr=self.lr)
        return torch.optim.SGD(groups, lr=self.lr)


def make_trainer(callbacks=(), max_steps=20, logger=None, **kwargs) -> pl.Trainer:
    defaults = dict(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=logger if logger is not None else MemoryLogger(),
        callbacks=list(callbacks), log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def gac_oracle(reference, raw, theta, c_low, c_high, decay, masks=None):
    """docs/callbacks.md's rule and references on the full vectors, in float64, written out by hand: (c_t, g~_t)
    per step.

    References: "grad" r = g_{t-1}; "applied" r = g~_{t-1}; "update" r = theta_{t-1} - theta_t;
    "ema" r = decay r + (1 - decay) g_{t-1} (starting from g_0). No reference at t = 0: the gradient is kept.
    ``masks`` (one bool vector per step) marks the parameters with a gradient: a missing gradient is zero in
    ``raw``, and the applied gradient is g - alpha r where there is one and zero (still no gradient) elsewhere."""
    r, cos, applied = None, [], []
    for t, g in enumerate(raw):
        if reference == "update" and t > 0:
            r = theta[t - 1] - theta[t]
        c = float("nan") if r is None else float(g @ r / (g.norm() * r.norm()))
        k = 0.0 if r is None or c <= c_low else (1.0 - c_low / c if c < c_high else 1.0)
        g_tilde = g
        if k:
            g_tilde = g - k * (g @ r) / (r @ r) * r
            if masks is not None:
                g_tilde = torch.where(masks[t], g_tilde, 0.0)
        cos.append(c)
        applied.append(g_tilde)
        if reference == "grad":
            r = g
        elif reference == "applied":
            r = g_tilde
        elif reference == "ema":
            r = g if r is None else decay * r + (1 - decay) * g
    return cos, applied


def report_cell(task, method, s, seed, final, reward=None, hib=True):
    """A done cell's record as the report reads it: ``final`` metric, and a GRPO reward trace when ``reward``."""
    rec = {"task": task, "method": method, "staleness": s, "seed": seed, "status": "done", "ablation": False,
           "metric": "reward", "higher_is_better": hib, "initial": 0.0, "final": final, "diverged": False,
           "cos_median": 0.0, "cos_abs_q90": 0.1, "cos_abs_le_005": 0.5, "cos_max_abs": 0.2}
    if reward is not None:
        rec.update({"reward_first": 0.0, "reward_last": reward, "reward_drop": 0.0, "degraded": False})
    return rec


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


@pytest.fixture
def regressor():
    return UserRegressor


TINY_TASK = dict(max_ops=2, max_operand=4)  # prompts of 4 and 6 tokens


@pytest.fixture(scope="session")
def tiny_llm_dir(tmp_path_factory):
    """A small warm-started tiny Qwen3 (built once per test session) for the LLM tests."""
    pytest.importorskip("transformers")
    from gacbench.llm.model import tiny_config
    from gacbench.llm.task import ArithmeticTask
    from gacbench.llm.warmstart import warm_started_dir

    cfg = tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    return str(warm_started_dir(cfg, ArithmeticTask(**TINY_TASK), steps=60, cache_dir=tmp_path_factory.mktemp("llm")))


def quadratic_suite(tmp_path: Path, name: str = "tiny.yaml", **over) -> Path:
    """A small bench suite on the noisy quadratic (sync, stale and gac at s = 0 and 4, 30 steps), written to
    ``tmp_path / name``; ``over`` replaces top-level keys."""
    suite = {
        "name": "tiny", "steps": 30, "warmup": 5,
        "tasks": {"quadratic": {"objective": "quadratic",
                                "params": {"optimizer": "sgd", "lr": 0.1, "sigma2": 10.0, "kappa": 10.0}}},
        "methods": ["sync", "stale", "gac"], "staleness": [0, 4], "seeds": [0],
    }
    suite.update(over)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(suite))
    return path


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_this_provenance(record: dict) -> None:
    """``record`` (a command's --json file) names the code version, the packages and the machine of this process."""
    from gacbench.provenance import provenance

    got, want = record["provenance"], provenance()
    for key in ("code", "source_sha256", "packages", "device", "isa", "cpu_vendor", "cpu_model", "cpu_flags"):
        assert got[key] == want[key], key


def squash(text: str) -> str:
    """``text`` with every run of white space as one space (rich wraps long lines)."""
    return " ".join(text.split())


def bench(suite: Path, out: Path, *extra: str) -> int:
    """``gacbench bench --suite SUITE --out OUT --workers 1 EXTRA...`` in this process; its exit status."""
    from gacbench.cli import main

    return main(["bench", "--suite", str(suite), "--out", str(out), "--workers", "1", *extra])


def signal_grpo_mid_fit(args: list[str], run_dir: Path, cwd: Path, signum: int,
                        env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``gacbench grpo ARGS`` in a child process (this checkout's gacbench; ``env`` added to its environment),
    send it ``signum`` once its first checkpoint (step 2) is written, in the middle of fit; returns (exit status,
    stderr)."""
    import os
    import subprocess
    import sys
    import time

    code = "import sys; from gacbench.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "grpo", *args], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 400
        while not (run_dir / "checkpoints" / "epoch=0-step=2.ckpt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, err
