"""gacbench step-profile: every phase of a GRPO step timed, the totals and shares consistent, strict JSON, and bad
options refused in one line."""

import json

import pytest
from conftest import assert_this_provenance

from gacbench.cli import main


def test_step_profile_times_every_phase_of_a_grpo_step(tiny_llm_dir, tmp_path, capsys):
    pytest.importorskip("transformers")
    from gacbench.llm.step_profile import PHASES

    out = tmp_path / "profile.json"
    assert main(["step-profile", "--engine", "hf", "--model", tiny_llm_dir, "--prompts", "3", "--group", "4",
                 "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    rec = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c}"))
    assert set(rec["phases_s"]) == set(PHASES) and all(v >= 0 for v in rec["phases_s"].values())
    assert_this_provenance(rec)
    for key in PHASES:  # the medians are of the stored repeats
        assert len(rec["all_s"][key]) == 2
        assert rec["phases_s"][key] == pytest.approx(sum(rec["all_s"][key]) / 2)
    assert rec["stale_step_s"] == pytest.approx(sum(rec["phases_s"].values()))
    assert rec["sync_step_s"] == pytest.approx(rec["stale_step_s"] - rec["phases_s"]["behaviour"])
    assert sum(rec["share"].values()) == pytest.approx(1.0)
    # the thread count used; 1 as asked unless a vLLM engine built earlier in this process fixed it
    import torch

    assert rec["threads"] == torch.get_num_threads() and rec["prompts"] == 3 and rec["group"] == 4 and rec["params"] > 0
    assert 0 < rec["tokens_per_response"] <= 6
    assert "step-profile: weight_sync" in capsys.readouterr().err


@pytest.mark.parametrize("args, words", [
    (["--repeats", "0"], "--repeats 0"),
    (["--threads", "0"], "--threads 0"),
    (["--size", "huge"], "--size 'huge'"),
    (["--task", "nope"], "--task 'nope'"),
    (["--model", "/nonexistent"], "no config.json"),
    (["--peak-tflops", "0"], "--peak-tflops 0"),
    (["--peak-tflops", "nan"], "--peak-tflops nan"),
    (["--peak-tflops", "inf"], "--peak-tflops inf"),
    (["--shape", "tiny-random", "--model", "/x"], "--shape or --model"),
    (["--compile"], "engine.compile=true is for the vllm engine in float32"),
    (["--logit-rows", "0"], "--logit-rows 0"),
    (["--logprob-rows", "0"], "rollout.logprob_rows=0"),  # refused as GRPO refuses it, not replaced by the default
])
def test_step_profile_refuses_bad_options_in_one_line(args, words, capsys):
    assert main(["step-profile", "--engine", "hf", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1



def test_a_shape_beyond_the_machines_memory_is_refused_before_it_is_built(monkeypatch, capsys):
    """On the CPU, --shape qwen3-1.7b needs 20 bytes a parameter (34 GB) before activations: refused in one line
    where less is available, before the 7 GB checkpoint is built; tiny-random (about 1.3M parameters) fits."""
    import torch

    from gacbench import provenance
    from gacbench.llm import step_profile

    monkeypatch.setattr(provenance, "available_memory", lambda: (24 * 10**9, 32 * 10**9))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # profiled on the CPU
    built = []
    monkeypatch.setattr(step_profile, "shape_model_dir", lambda *a, **k: built.append(a) or "/nonexistent")
    assert main(["step-profile", "--engine", "hf", "--shape", "qwen3-1.7b"]) == 2
    err = capsys.readouterr().err
    assert "--shape qwen3-1.7b: 1.72B parameters need about 34 GB" in err and "24 GB available" in err
    assert len(err.strip().splitlines()) == 1 and built == []
    step_profile.check_shape_fits("tiny-random")  # no error


def test_flop_floor_by_hand():
    """1e9 parameters, 1000 tokens at 100 TFLOP/s: forward 2e12 FLOPs = 20 ms, backward 4e12 = 40 ms."""
    from gacbench.llm.step_profile import flop_floor

    floor = flop_floor(10**9, 1000, 100.0)
    assert floor == {"forward_s": pytest.approx(0.02), "backward_s": pytest.approx(0.04)}


def test_the_qwen3_shape_is_qwen3_1_7b():
    """--shape qwen3-1.7b is the architecture whose parameter list `gacbench overhead --shape qwen3-1.7b` times
    (1.72B parameters, tied embeddings), counted from the config without building the model."""
    from gacbench.bench.overhead import QWEN3_1_7B
    from gacbench.llm.step_profile import SHAPES

    s = SHAPES["qwen3-1.7b"]
    assert (s["hidden"], s["layers"], s["intermediate"], s["heads"], s["kv_heads"], s["vocab"]) == (
        QWEN3_1_7B.hidden, QWEN3_1_7B.layers, QWEN3_1_7B.intermediate, QWEN3_1_7B.heads, QWEN3_1_7B.kv_heads,
        QWEN3_1_7B.vocab)
    assert s["hidden"] // s["heads"] == QWEN3_1_7B.head_dim


@pytest.mark.slow
def test_step_profile_at_a_random_weight_shape_reports_speeds_and_the_flop_floor(tmp_path, monkeypatch):
    """--shape tiny-random: the code path of --shape qwen3-1.7b at a CPU's size (a model built from a config,
    random weights, the tiny tokenizer over a larger vocabulary), with the memory settings of the GPU command."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("GACBENCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "profile.json"
    assert main(["step-profile", "--engine", "hf", "--shape", "tiny-random", "--prompts", "2", "--group", "2",
                 "--max-tokens", "4", "--repeats", "1", "--gradient-checkpointing", "--logit-rows", "3",
                 "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["shape"] == "tiny-random" and rec["device"] == "cpu" and rec["peak_memory_gib"] is None
    assert rec["gradient_checkpointing"] is True and rec["logit_rows"] == 3
    assert rec["params"] == pytest.approx(4096 * 128 + 4 * (2 * 128 * 128 + 2 * 64 * 128 + 3 * 128 * 384
                                                            + 2 * 32 + 2 * 128) + 128)
    floor = rec["flop_floor_s"]
    assert floor["backward_s"] == pytest.approx(2 * floor["forward_s"])
    assert floor["forward_s"] == pytest.approx(2 * rec["params"] * rec["batch_tokens_median"] / 790e12)
    assert rec["forward_over_floor"] == pytest.approx(rec["phases_s"]["forward"] / floor["forward_s"])
    assert rec["step_tokens_per_s"] == pytest.approx(rec["batch_tokens_median"] / rec["stale_step_s"])


def test_the_first_round_warms_up_and_is_not_timed():
    """AdamW allocates its moments at its first step: that round is run but left out of every phase's times."""
    import time

    import torch

    from gacbench.llm.step_profile import PHASES, time_phases

    class Slow(torch.optim.SGD):
        calls = 0

        def step(self, closure=None):
            Slow.calls += 1
            if Slow.calls == 1:
                time.sleep(0.3)  # as a first AdamW step allocating its state
            return super().step(closure)

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))
            self.global_step, self._times, self.rollouts = 0, {}, 0

        def configure_optimizers(self):
            return Slow(self.parameters(), lr=0.1)

        def sync_engine(self, version):
            pass

        def start_step_counters(self):
            self._times = {"time/generate_s": 0.0, "time/behav_s": 0.0}

        def rollout(self):
            self.rollouts += 1
            return {"packed": {"mask": torch.ones(2, 3), "attention": torch.ones(2, 5)}}

        def policy_loss(self, data):
            return (self.w ** 2).sum(), {}

    module = Module()
    timed = time_phases(module, repeats=3)
    assert module.rollouts == 4 and Slow.calls == 4  # one untimed round, then three timed ones
    assert all(len(timed["seconds"][k]) == 3 for k in PHASES) and len(timed["tokens"]) == 3
    assert max(timed["seconds"]["optimizer"]) < 0.2


def test_available_memory_reads_memavailable_not_memfree(monkeypatch):
    """What a new process can use is /proc/meminfo's MemAvailable (free plus reclaimable caches), not MemFree."""
    import builtins
    import io

    from gacbench.provenance import available_memory

    fake = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    600 kB\n"
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: io.StringIO(fake) if f == "/proc/meminfo"
                        else real_open(f, *a, **k))
    assert available_memory() == (600 * 1024, 1000 * 1024)
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: io.StringIO("MemTotal: 1000 kB\n"))
    assert available_memory() == (None, None)
