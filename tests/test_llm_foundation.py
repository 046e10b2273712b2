"""The LLM foundation: the procedural task, the tokenizer, the tiny model's cache and loading path (the rollout
engines are tested in test_engines.py)."""

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from gacbench.llm.model import build_tokenizer, cached_model_dir, config_key, load, tiny_config  # noqa: E402
from gacbench.llm.task import ArithmeticTask, exact_reward  # noqa: E402


def test_problems_are_deterministic_correct_and_splits_disjoint():
    task = ArithmeticTask(max_ops=3, seed=1)
    train = task.batch("train", 0, 300)
    assert train == ArithmeticTask(max_ops=3, seed=1).batch("train", 0, 300)
    for p in train[:50]:
        assert p.prompt.endswith("=") and str(eval(p.prompt[:-1])) == p.answer
    evals = {p.prompt for p in task.batch("eval", 0, 100)}
    assert not evals & {p.prompt for p in train}
    with pytest.raises(ValueError, match="split"):
        task.problem("test", 0)
    with pytest.raises(ValueError, match="eval_fraction"):
        ArithmeticTask(eval_fraction=0.0)
    # drawn once per process: a task of equal settings reads the same problems, a draw of its own equals them
    assert task.problem("eval", 7) is ArithmeticTask(max_ops=3, seed=1).problem("eval", 7) == task._problem("eval", 7)
    assert ArithmeticTask(max_ops=3, seed=2).problem("eval", 7) != task.problem("eval", 7)


@pytest.mark.parametrize("cls", ["ArithmeticTask", "ScratchpadTask"])
def test_a_task_whose_split_holds_no_problem_is_refused_at_construction_naming_the_settings(cls):
    from gacbench.llm import task as tasks
    from gacbench.usage import UsageError

    # one operation on 0..1 or 0..2: 12 or 27 prompts, none of them in the 5% eval bucket (drawing would not end)
    small = {"max_ops": 1, "max_operand": 2, "eval_fraction": 0.05}
    if cls == "ScratchpadTask":
        small["min_ops"] = 1
    with pytest.raises(UsageError, match=r"eval split holds no problem.*task.max_operand"):
        getattr(tasks, cls)(**small)
    assert getattr(tasks, cls)(**{**small, "max_operand": 9}).problem("eval", 3).prompt  # a larger space has both


def test_the_warm_start_of_an_arithmetic_run_never_trains_on_its_eval_problems():
    from gacbench.llm.task import _is_eval
    from gacbench.llm.tasks import TaskConfig, build_task
    from gacbench.llm.warmstart import warm_task

    for fraction in (0.1, 0.3):
        cfg = TaskConfig(eval_fraction=fraction)
        warm = warm_task(cfg, build_task(cfg, 0))
        assert warm == ArithmeticTask(max_ops=cfg.max_ops, max_operand=cfg.max_operand, eval_fraction=fraction)
    # what that prevents: the default warm task's training problems include some of a 0.3 run's eval problems
    assert any(_is_eval(p.prompt, 0.3) for p in ArithmeticTask().batch("train", 0, 2000))


def test_a_prompt_is_held_out_when_its_hash_bucket_lies_below_the_eval_fraction():
    """The split is a hash bucket in [0, 10000) below eval_fraction x 10000: the bucket at the boundary is train
    data, the one below it eval data."""
    import hashlib

    from gacbench.llm.task import _is_eval

    def bucket(text: str) -> int:
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % 10_000

    at = "0+692="
    assert bucket(at) == 2000
    assert not _is_eval(at, 0.2) and _is_eval(at, 0.2001)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), None, "1.0?"])
def test_a_reward_that_returns_no_finite_number_is_refused_naming_it(value):
    from gacbench.llm.tasks import score

    def odd(completion, answer):
        return value

    with pytest.raises(ValueError, match=r"reward 'odd' returned .* must return a finite number"):
        score(odd, "12", "12")
    assert score(lambda c, a: True, "12", "12") == 1.0 and score(lambda c, a: 0, "1", "2") == 0.0


def test_exact_reward():
    assert exact_reward("31", "31") == 1.0 and exact_reward("3 1\nxyz", "31") == 1.0
    assert exact_reward("310", "31") == 0.0 and exact_reward("", "31") == 0.0
    assert exact_reward("(35, 36)", "(35, 36)") == 1.0 and exact_reward("(35,36)\n", "(35, 36)") == 1.0  # a spaced gold


def test_a_completion_is_scored_on_what_it_wrote_up_to_its_end_with_inner_special_tokens_kept():
    from gacbench.llm.model import completion_text

    tok = build_tokenizer()
    pad, bos, eos = tok.pad_token_id, tok.bos_token_id, tok.eos_token_id
    one, two = tok.convert_tokens_to_ids(["1", "2"])
    assert completion_text(tok, [one, two, eos]) == "12"
    assert completion_text(tok, torch.tensor([one, two, eos, pad, pad])) == "12"  # a batch's padding after the end
    assert completion_text(tok, [one, two]) == "12"  # cut off by max_tokens
    for inner in ([one, pad, two, eos], [bos, one, bos, two, eos]):  # sampled inside the completion: not "12"
        text = completion_text(tok, inner)
        assert text != "12" and exact_reward(text, "12") == 0.0


def test_tokenizer_round_trips_the_task_alphabet():
    tok = build_tokenizer()
    for text in ("3+14*2=31", "9-7=2\n", "0*0=0"):
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_model_is_built_once_per_config_and_loaded_like_any_checkpoint(tmp_path):
    cfg = tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    d1 = cached_model_dir(cfg, tmp_path)
    mtime = (d1 / "config.json").stat().st_mtime_ns
    assert cached_model_dir(cfg, tmp_path) == d1 and (d1 / "config.json").stat().st_mtime_ns == mtime
    assert config_key(cfg) != config_key(tiny_config(hidden=64, layers=3, heads=2, kv_heads=1, intermediate=128))
    model, tok = load(d1)
    ids = torch.tensor([tok.encode("3+4=", add_special_tokens=False)])
    assert model(ids).logits.shape == (1, 4, cfg.vocab_size)


def test_a_cache_entry_installed_meanwhile_is_kept_and_an_incomplete_one_replaced(tmp_path, monkeypatch):
    import os

    from gacbench.llm import model as M

    def built(name: str, mark: str):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(mark)
        return d

    # another process installs the entry between this one's check and its rename: its copy is kept, no error
    path, rename = tmp_path / "entry", os.replace
    def racing(src, dst):
        if Path(src).name == "mine.tmp" and not Path(dst).exists():
            rename(built("theirs.tmp", "theirs"), dst)
        return rename(src, dst)
    monkeypatch.setattr(M.os, "replace", racing)
    M.install_dir(built("mine.tmp", "mine"), path)
    assert (path / "config.json").read_text() == "theirs" and not (tmp_path / "mine.tmp").exists()
    monkeypatch.setattr(M.os, "replace", rename)
    # an entry without config.json (a copy cut short) is replaced by the new build, not returned as it is
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_text("partial")
    M.install_dir(built("new.tmp", "new"), broken)
    assert (broken / "config.json").read_text() == "new" and not (broken / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "entry"]


def test_bad_model_path_and_config_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local Hugging Face checkpoint"):
        load(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="head_dim"):
        tiny_config(hidden=64, heads=4)
    # a directory with a config.json that transformers cannot load: one UsageError naming the path and the cause
    from gacbench.usage import UsageError

    for name, text in (("damaged", "{not json"), ("no-weights", '{"model_type": "qwen3"}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(text)
        with pytest.raises(UsageError, match=f"model path {tmp_path / name} has a config.json but cannot be loaded"):
            load(tmp_path / name)
    # a checkpoint missing files, or cut short: transformers would build an empty tokenizer, or one that does not
    # fit the embedding, and fail later in the run
    import shutil

    src = cached_model_dir(tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128), tmp_path)
    for case, words in (("tokenizer.json", "cannot be loaded as a Hugging Face checkpoint"),
                        ("tokenizer.json tokenizer_config.json", "encodes text to no tokens \\(no tokenizer files"),
                        ("tokenizer_config.json", "token 18 lies beyond the model's 18 embedding rows"),
                        ("cut", "cannot be loaded as a Hugging Face checkpoint \\(SafetensorError")):
        d = tmp_path / f"without-{case.replace(' ', '-')}"
        shutil.copytree(src, d)
        if case == "cut":
            (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:50])
        else:
            for name in case.split():
                (d / name).unlink()
        with pytest.raises(UsageError, match=f"model path {d}.*{words}"):
            load(d)
    # an unused extra token beyond the embedding rows (released tokenizers have some) is not a refusal
    model, tok = load(src)
    tok.add_special_tokens({"additional_special_tokens": ["<unused>"]})
    extra = tmp_path / "extra-token"
    model.save_pretrained(extra)
    tok.save_pretrained(extra)
    model, tok = load(extra)
    assert len(tok) == model.get_input_embeddings().weight.shape[0] + 1


def _tiny(tmp_path):
    from gacbench.llm.model import load

    cfg = tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    return load(cached_model_dir(cfg, tmp_path))


def test_sft_batch_supervises_only_the_answer():
    from gacbench.llm.task import Problem
    from gacbench.llm.warmstart import sft_batch

    tok = build_tokenizer()
    ids, lab = sft_batch(tok, [Problem("3+4=", "7"), Problem("12*3=", "36")])
    assert ids.shape == lab.shape == (2, 9)
    assert lab[0].tolist()[:4] == [-100] * 4 and tok.decode(lab[0, 4:6]) == "7\n" and lab[0, 6] == tok.eos_token_id
    assert lab[0, 7:].tolist() == [-100, -100] and ids[0, 7:].tolist() == [tok.pad_token_id] * 2


def test_warm_start_learns_and_is_cached(tmp_path):
    from gacbench.llm.warmstart import greedy_accuracy, warm_start, warm_started_dir

    cfg = tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    task = ArithmeticTask(max_ops=1, max_operand=4)
    model, tok = _tiny(tmp_path)
    losses = warm_start(model, tok, task, steps=40, batch_size=32)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    acc = greedy_accuracy(model, tok, task.batch("eval", 0, 20))
    assert 0.0 <= acc <= 1.0
    d = warm_started_dir(cfg, task, steps=5, cache_dir=tmp_path)
    stamp = (d / "config.json").stat().st_mtime_ns
    assert (warm_started_dir(cfg, task, steps=5, cache_dir=tmp_path) == d
            and (d / "config.json").stat().st_mtime_ns == stamp)

    assert warm_started_dir(cfg, task, steps=6, cache_dir=tmp_path) != d


def test_grpo_cells_run_through_the_bench_runner_with_the_vllm_engine(tiny_llm_dir, tmp_path):
    """The CI variant of `gacbench bench --suite llm-smoke` with vLLM rollouts: two cells, four steps."""
    pytest.importorskip("vllm")
    from conftest import TINY_TASK

    from gacbench.bench.report import build_report
    from gacbench.bench.runner import run_grid

    params = {"model": {"path": tiny_llm_dir}, "engine": {"name": "vllm"}, "task": dict(TINY_TASK),
              "rollout": {"prompts": 4, "group": 4, "max_tokens": 4}, "eval_every": 2, "eval_size": 8}
    base = {"task": "arith", "objective": "grpo", "steps": 4, "warmup": 0, "params": params}
    cells = [{**base, "method": "sync", "staleness": 0, "seed": 0},
             {**base, "method": "gac+m2po", "staleness": 2, "seed": 0}]
    assert run_grid(cells, tmp_path)["failed"] == 0
    summary = build_report(tmp_path, cells)["summary"]
    assert {c["engine"] for c in summary["cells"]} == {"vllm"}
    import csv

    rows = list(csv.DictReader((tmp_path / "cells/arith/gac+m2po/s2/seed0/metrics.csv").open()))
    assert [float(r["stale/lag"]) for r in rows if r.get("stale/lag")] == [0.0, 1.0, 2.0, 2.0]
    assert max(abs(float(r["is/engine_mismatch_kl"])) for r in rows if r.get("is/engine_mismatch_kl")) < 1e-4
    assert sum(1 for r in rows if r.get("m2po/m2")) == 4
