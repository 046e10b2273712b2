"""The scratchpad task (long answers), its final-line reward and warm-start, the medium model size, and the
per-step response length and parameter count of a GRPO run."""

import re

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from gacbench.llm.model import MODEL_SIZES, build_tokenizer, config_key, sized_config, tiny_config  # noqa: E402
from gacbench.llm.task import (  # noqa: E402
    ArithmeticTask,
    Problem,
    ScratchpadTask,
    final_line_reward,
    scratchpad_lines,
)
from gacbench.llm.tasks import TaskConfig, build_task, reward_fn  # noqa: E402
from gacbench.usage import UsageError  # noqa: E402

STEP = re.compile(r"^(-?\d+)([+*-])(\d+)=(-?\d+)$")


def test_scratchpad_lines_by_hand():
    # 2+3*4-5: the product first, then left to right
    assert scratchpad_lines([2, 3, 4, 5], ["+", "*", "-"]) == (["3*4=12", "2+12=14", "14-5=9"], 9)
    # 7-8*9*2: the leftmost product first; negative intermediate values keep their sign
    assert scratchpad_lines([7, 8, 9, 2], ["-", "*", "*"]) == (["8*9=72", "72*2=144", "7-144=-137"], -137)
    assert scratchpad_lines([1, 0], ["-"]) == (["1-0=1"], 1)


def test_problems_are_deterministic_correct_and_splits_disjoint():
    task = ScratchpadTask(seed=3)
    train = task.batch("train", 0, 400)
    assert train == ScratchpadTask(seed=3).batch("train", 0, 400)
    assert train != ScratchpadTask(seed=4).batch("train", 0, 400)
    for p in train:
        value = eval(p.prompt[:-1], {"__builtins__": {}})
        lines = p.solution.split("\n")
        assert p.prompt.endswith("=") and p.answer == str(value) and lines[-1] == p.answer
        assert len(lines) == 4  # three operations, then the answer
        for line in lines[:-1]:  # every scratchpad line is a true equation
            a, op, b, c = STEP.match(line).groups()
            assert eval(f"{a}{op}{b}", {"__builtins__": {}}) == int(c)
    evals = task.batch("eval", 0, 400)
    assert not {p.prompt for p in evals} & {p.prompt for p in train}
    assert ScratchpadTask(seed=3).batch("eval", 50, 5) == evals[50:55]
    with pytest.raises(ValueError, match="split"):
        task.problem("test", 0)
    with pytest.raises(UsageError, match="need 1 <= min_ops <= max_ops .* min_ops=3, max_ops=2"):
        ScratchpadTask(min_ops=3, max_ops=2)
    with pytest.raises(UsageError, match="eval_fraction"):
        ScratchpadTask(eval_fraction=1.0)


def test_correct_completions_are_at_least_24_tokens_on_average_and_fit_the_context():
    tok = build_tokenizer()
    lengths = [len(tok.encode(p.target + "\n", add_special_tokens=False)) + 1  # + eos
               for p in ScratchpadTask().batch("train", 0, 2000)]
    assert sum(lengths) / len(lengths) >= 24
    assert max(lengths) <= 48  # rollout.max_tokens of the llm-length suite
    prompts = [len(p.prompt) for p in ScratchpadTask().batch("train", 0, 2000)]
    assert max(prompts) + 48 <= tiny_config().max_position_embeddings


def test_final_line_reward_on_hand_cases():
    right = "3*4=12\n2+12=14\n14-5=9\n9\n"
    assert final_line_reward(right, "9") == 1.0
    assert final_line_reward(right.rstrip("\n"), "9") == 1.0  # no trailing newline
    assert final_line_reward("3*4=12\n2+12=14\n14-5=9\n 9 \n", "9") == 1.0  # spaces ignored
    assert final_line_reward("so\n(35, 36)", "(35, 36)") == 1.0  # in the gold too
    assert final_line_reward("3*4=12\n2+12=14\n14-5=9\n8\n", "9") == 0.0  # wrong answer
    assert final_line_reward("3*4=12\n2+12=14\n14-5=9\n9\n7\n", "9") == 0.0  # extra text after the answer
    assert final_line_reward("3*4=12\n2+12=14\n14-5=", "9") == 0.0  # cut off mid-scratchpad
    assert final_line_reward("3*4=12\n2+12=14\n14-5=9\n99", "9") == 0.0
    assert final_line_reward("", "9") == 0.0 and final_line_reward("\n\n", "9") == 0.0
    # a malformed scratchpad earns the reward when its final line is right: only the answer is checked
    assert final_line_reward("3*4=13\n=\n9\n", "9") == 1.0 and final_line_reward("9", "9") == 1.0
    assert final_line_reward("3*4=12\n2+12=14\n14-5=9", "-9") == 0.0


def test_registry_builds_the_task_with_its_options_and_default_reward():
    task = build_task(TaskConfig(name="scratchpad", options={"min_ops": 2, "max_operand": 5}), seed=7)
    assert task == ScratchpadTask(min_ops=2, max_ops=3, max_operand=5, seed=7)
    assert reward_fn(task.default_reward) is final_line_reward
    assert build_task(TaskConfig(name="scratchpad", eval_fraction=0.2), 0).eval_fraction == 0.2
    with pytest.raises(ValueError, match="task.options 'ops': not an option of task 'scratchpad'.*min_ops, max_ops, "
                                         "max_operand"):
        build_task(TaskConfig(name="scratchpad", options={"ops": 2}), 0)


def test_tokenizer_round_trips_the_task_alphabet_without_unknown_tokens():
    tok = build_tokenizer()
    unknown = tok.convert_tokens_to_ids("<pad>")  # the character tokenizer maps unknown characters to <pad>
    for p in ScratchpadTask().batch("train", 0, 300) + ScratchpadTask().batch("eval", 0, 100):
        text = p.prompt + p.target + "\n"
        ids = tok.encode(text, add_special_tokens=False)
        assert unknown not in ids and len(ids) == len(text)
        assert tok.decode(ids) == text


def test_sft_batch_supervises_the_whole_solution():
    from gacbench.llm.warmstart import sft_batch

    tok = build_tokenizer()
    p = Problem("2+3*4-5=", "9", "3*4=12\n2+12=14\n14-5=9\n9")
    ids, lab = sft_batch(tok, [p, Problem("3+4=", "7")])
    n = len(p.prompt)
    assert lab[0, :n].tolist() == [-100] * n
    assert tok.decode(lab[0, n:-1]) == p.solution + "\n" and lab[0, -1] == tok.eos_token_id
    assert tok.decode(ids[0], skip_special_tokens=True) == p.prompt + p.solution + "\n"
    assert tok.decode(lab[1, 4:6]) == "7\n"  # a problem without a solution: the answer, as before


def test_warm_task_is_the_runs_task_for_scratchpad_and_arithmetic_otherwise(tmp_path):
    from gacbench.llm.warmstart import warm_started_dir, warm_task

    cfg = TaskConfig(name="scratchpad", options={"max_operand": 5})
    assert warm_task(cfg, build_task(cfg, seed=4)) == ScratchpadTask(max_operand=5, seed=0)
    arith = TaskConfig(max_ops=1, max_operand=4)
    assert warm_task(arith, build_task(arith, seed=4)) == ArithmeticTask(max_ops=1, max_operand=4)

    # the arithmetic warm-start's cache directory keeps its name: an existing checkpoint there is reused as is
    # (300 steps: a start point no suite pins, so the cache decides)
    config = tiny_config()
    kept = tmp_path / f"warm-{config_key(config)}-max_ops2-max_operand9-eval_fraction0.1-seed0-sft300-seed0"
    kept.mkdir()
    (kept / "config.json").write_text("{}")
    assert warm_started_dir(config, ArithmeticTask(), steps=300, cache_dir=tmp_path) == kept
    # a pinned start point (the shipped suites' 400 steps) is the shipped checkpoint, whatever the cache holds
    from gacbench.llm import pinned

    name = kept.name.replace("sft300", "sft400")
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text("{}")
    assert warm_started_dir(config, ArithmeticTask(), steps=400, cache_dir=tmp_path) == pinned.models_root() / name


def test_warm_start_on_the_scratchpad_task_learns_and_is_cached_apart(tmp_path):
    from gacbench.llm.model import cached_model_dir, load
    from gacbench.llm.warmstart import warm_start, warm_started_dir

    cfg = tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    task = ScratchpadTask(min_ops=1, max_ops=1, max_operand=4)
    model, tok = load(cached_model_dir(cfg, tmp_path))
    losses = warm_start(model, tok, task, steps=30, batch_size=16)
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5
    d = warm_started_dir(cfg, task, steps=2, cache_dir=tmp_path)
    assert d.name.startswith("warm-ScratchpadTask-") and (d / "config.json").exists()
    assert warm_started_dir(cfg, ArithmeticTask(max_ops=1, max_operand=4), steps=2, cache_dir=tmp_path) != d


def test_the_medium_size_has_at_least_15m_parameters_and_the_shared_vocabulary():
    from transformers import Qwen3ForCausalLM

    counts = {}
    for size in MODEL_SIZES:
        config = sized_config(size)
        assert config.vocab_size == len(build_tokenizer())  # every size reads the same character tokenizer
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            counts[size] = sum(p.numel() for p in Qwen3ForCausalLM(config).parameters())
    assert counts["medium"] >= 15_000_000 and counts["medium"] > 3 * counts["small"] > 9 * counts["tiny"]
    assert sized_config("medium").head_dim >= 32  # vLLM's CPU attention
    with pytest.raises(ValueError, match="model.size='huge' is not one of tiny, small, medium"):
        sized_config("huge")


def test_a_task_the_tokenizer_erases_or_whose_answers_cannot_fit_is_refused(tmp_path):
    """The tiny tokenizer encodes a character it does not know as its padding token (every row of a dataset is
    read), and a max_tokens shorter than every answer leaves no rollout rewardable: both are refused when the module
    is built. A scratchpad that does not fit is not refused: the final-line reward reads the answer alone."""
    from gacbench.llm.datasets import MathDataset
    from gacbench.llm.grpo import check_task_text
    from gacbench.llm.model import cached_model_dir, load

    _, tok = load(cached_model_dir(tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128), tmp_path))
    rows = [f'{{"problem": "{i}+{i}=", "answer": "{2 * i}"}}\n' for i in range(1000)]
    rows[700] = '{"problem": "7 + 7 =", "answer": "14"}\n'  # beyond any sample of the first rows
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_text("".join(rows))
    with pytest.raises(ValueError, match=r"task 'math': the tokenizer of M has no token for ' ' in the (train|eval) "
                                         r"prompt '7 \+ 7 ='.*model.path"):
        check_task_text(MathDataset(spaced, eval_fraction=0.3), tok, 6, "math", "M")
    long = tmp_path / "long.jsonl"
    long.write_text("".join(f'{{"problem": "{i}+{i}=", "answer": "{123456 + i}"}}\n' for i in range(40)))
    with pytest.raises(ValueError, match="max_tokens=3 is shorter than every answer .* at least 6"):
        check_task_text(MathDataset(long, eval_fraction=0.3), tok, 3, "math", "M")
    check_task_text(MathDataset(long, eval_fraction=0.3), tok, 6, "math", "M")
    task = ScratchpadTask()
    assert min(len(tok.encode(p.target, add_special_tokens=False)) for p in task.batch("train", 0, 256)) > 6
    check_task_text(task, tok, 6, "scratchpad", "M")  # the answer alone fits, and is rewarded
    assert final_line_reward("20\n", "20") == 1.0
    check_task_text(ArithmeticTask(), tok, 6, "arithmetic", "M", rows=18)
    with pytest.raises(ValueError, match="with a token beyond the model's 5 embedding rows"):
        check_task_text(ArithmeticTask(), tok, 6, "arithmetic", "M", rows=5)  # a tokenizer not of this model


def test_grpo_logs_the_response_length_and_parameter_count(tmp_path):
    """Two synchronous GRPO steps on the scratchpad task with the HF engine: response/tokens_mean is the mean
    completion length of the batch trained on (eos included), model/params the policy's parameter count."""
    import lightning.pytorch as pl

    from gacbench.llm.grpo import GRPOModule
    from gacbench.llm.model import cached_model_dir
    from gacbench.llm.warmstart import warm_started_dir

    cfg = tiny_config(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)
    task = ScratchpadTask(min_ops=1, max_ops=1, max_operand=4)
    path = warm_started_dir(cfg, task, steps=5, cache_dir=tmp_path)
    assert cached_model_dir(cfg, tmp_path).exists()
    module = GRPOModule(model={"path": str(path)}, task={"name": "scratchpad", "options": {"min_ops": 1,
                        "max_ops": 1, "max_operand": 4}}, rollout={"prompts": 2, "group": 2, "max_tokens": 12},
                        steps=2, eval_every=100, eval_size=4)
    lengths = []
    step = module.training_step

    def recording_step(batch, batch_idx):
        out = step(batch, batch_idx)
        lengths.append(float(module._consumed[module.global_step][1]["packed"]["mask"].sum()) / 4)
        logged = module.trainer.callback_metrics
        assert float(logged["response/tokens_mean"]) == pytest.approx(lengths[-1])
        assert float(logged["model/params"]) == sum(p.numel() for p in module.policy.parameters())
        return out

    module.training_step = recording_step
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(module)
    finally:
        from gacbench.rollout.engines import release_engines

        release_engines()
    assert len(lengths) == 2 and all(1 <= n <= 12 for n in lengths)


@pytest.mark.slow
def test_vllm_and_hf_give_the_same_greedy_answers_for_the_medium_architecture(tmp_path):
    """A freshly initialised model of the medium size's architecture: vLLM's greedy completions of a few
    scratchpad prompts are HF generate's, token for token."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from gacbench.llm.model import cached_model_dir, load
    from gacbench.rollout.engines import VLLMEngine

    d = cached_model_dir(sized_config("medium"), tmp_path)
    model, tok = load(d)
    prompts = [tok.encode(p.prompt, add_special_tokens=False) for p in ScratchpadTask().batch("eval", 0, 4)]
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=12, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
            expected.append(out[0, len(p):].tolist())
    engine = VLLMEngine(str(d), max_model_len=64, seed=0)
    try:
        outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0.0, max_tokens=12, detokenize=False), use_tqdm=False)
    finally:
        engine.close()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_the_report_carries_response_length_and_parameter_count_per_cell_and_group(tmp_path):
    """A stored grid whose stale cells logged response/tokens_mean and model/params (added to their
    metrics.csv): each such cell's record has the mean over its rows and the count, each such group the mean
    over seeds and the count; the other groups have neither key."""
    import csv
    import json

    import yaml

    from gacbench.bench.cell import cell_dir
    from gacbench.bench.report import build_report
    from gacbench.bench.runner import expand_cells, load_suite, run_grid

    suite = {"name": "len", "steps": 6, "warmup": 0, "tasks": {"bandit": {"objective": "bandit"}},
             "methods": ["sync", "stale"], "staleness": [0, 2], "seeds": [0, 1]}
    (tmp_path / "len.yaml").write_text(yaml.safe_dump(suite))
    out = tmp_path / "out"
    cells = expand_cells(load_suite(str(tmp_path / "len.yaml")))
    assert run_grid(cells, out)["failed"] == 0
    for cell in cells:
        if cell["method"] != "stale":
            continue
        path = cell_dir(out, cell) / "metrics.csv"
        with path.open() as f:
            rows = list(csv.DictReader(f))
        tokens = [20.0 + cell["seed"] + (i % 2) for i in range(len(rows))]  # per row: 20/21, or 21/22
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, [*rows[0], "response/tokens_mean", "model/params"])
            w.writeheader()
            for r, t in zip(rows, tokens):
                w.writerow({**r, "response/tokens_mean": t, "model/params": 17315456})
        cell["expected"] = sum(tokens) / len(tokens)
    build_report(out)
    summary = json.loads((out / "summary.json").read_text())
    stale = {c["seed"]: c for c in summary["cells"] if c["method"] == "stale"}
    expected = {c["seed"]: c["expected"] for c in cells if c["method"] == "stale"}
    for seed, rec in stale.items():
        assert rec["response_tokens"] == pytest.approx(expected[seed]) and rec["params"] == 17315456
    assert not any("response_tokens" in c for c in summary["cells"] if c["method"] == "sync")
    groups = {g["method"]: g for g in summary["groups"]}
    assert groups["stale"]["response_tokens_mean"] == pytest.approx((expected[0] + expected[1]) / 2)
    assert groups["stale"]["params"] == 17315456
    assert "response_tokens_mean" not in groups["sync"] and "params" not in groups["sync"]


def test_the_length_and_size_suites():
    from gacbench.bench.runner import expand_cells, load_suite
    from gacbench.llm.grpo import GRPOModule

    length = load_suite("llm-length")
    (spec,) = length["tasks"].values()
    params = spec["params"]
    assert params["task"]["name"] == "scratchpad" and params["model"]["size"] == "small"
    assert params["rollout"]["max_tokens"] >= 33  # the longest correct completion fits
    cells = expand_cells(length)
    assert len(cells) == 3 + 4 * 2 * 3 and {c["staleness"] for c in cells} == {0, 16, 32}
    assert set(length["methods"]) == {"sync", "stale", "gac", "gac-calibrated", "gspo"}
    # the other methods on long answers: a grid of its own on the same task, with its own sync and stale cells
    baselines = load_suite("llm-length-baselines")
    assert baselines["tasks"] == length["tasks"]
    assert (baselines["steps"], baselines["warmup"]) == (length["steps"], length["warmup"])
    assert set(baselines["methods"]) == {"sync", "stale", "dual-clip", "vcpo", "gac-step"}
    assert len(expand_cells(baselines)) == 3 + 4 * 2 * 3

    size = load_suite("llm-size")
    assert {t["params"]["model"]["size"] for t in size["tasks"].values()} == set(MODEL_SIZES)
    assert {t["params"]["task"]["name"] for t in size["tasks"].values()} == {"arithmetic"}
    cells = expand_cells(size)
    assert len(cells) == 3 * (3 + 4 * 3) and {c["staleness"] for c in cells} == {0, 16}
    for suite in (length, size):
        for t in suite["tasks"].values():
            GRPOModule.check_settings(t["params"])
