"""`gacbench grpo` (LightningCLI), the shipped configs, `gacbench rollout-bench`, and GRPO on a local
text math dataset through a real (non-arithmetic) tokenizer."""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jsonargparse")

from conftest import TINY_TASK  # noqa: E402

from gacbench.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _small(model_dir: str, out: Path) -> list[str]:
    return ["--config", str(ROOT / "tasks/llm/tiny.yaml"), "--model.model_path", model_dir, "--model.engine", "hf",
            "--model.prompts", "4", "--model.group", "4", "--model.max_tokens", "4", "--model.eval_size", "8",
            "--model.eval_every", "2", "--model.max_ops", str(TINY_TASK["max_ops"]),
            "--model.max_operand", str(TINY_TASK["max_operand"]), "--trainer.logger.init_args.save_dir", str(out)]


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "tasks/llm").glob("*.yaml")))
def test_shipped_configs_parse(config, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["grpo", "--config", str(ROOT / "tasks/llm" / config), "--print_config"])
    assert exit_.value.code == 0
    assert "model:" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:.*ckpt_path.*", "ignore:You're resuming from a checkpoint")
def test_grpo_command_runs_checkpoints_and_resumes(tiny_llm_dir, tmp_path, capsys):
    cfg = tmp_path / "ckpt.yaml"
    cfg.write_text("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                   "      init_args: {every_n_train_steps: 2, save_top_k: -1}\n")
    args = _small(tiny_llm_dir, tmp_path) + ["--config", str(cfg), "--method", "gac+m2po", "--model.staleness", "2"]
    assert main(["grpo", *args, "--trainer.max_steps", "4"]) == 0
    run_dir = tmp_path / "tiny" / "gac+m2po-s2-seed0"  # the config's logger name; version METHOD-sS-seedSEED
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["method"] == "gac+m2po" and summary["engine"] == "hf"
    assert 0.0 <= summary["eval_acc_final"] <= 1.0 and 0.0 < summary["generate_share"] < 1.0
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert all(k in header for k in ("align/cos", "m2po/m2", "stale/lag", "eval/acc", "time/generate_s"))
    assert (run_dir / "config.yaml").exists()  # LightningCLI's saved config
    assert main(["grpo", *args, "--trainer.max_steps", "6", "--ckpt_path", "last"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_from"].endswith("step=4.ckpt")
    import csv

    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))  # the steps before the resume are kept
    assert sorted({int(r["step"]) for r in rows if r.get("stale/lag")}) == list(range(6))
    assert [float(r["stale/lag"]) for r in rows if r.get("stale/lag")] == [0, 1, 2, 2, 2, 2]


def test_grpo_command_refuses_bad_settings(tiny_llm_dir, tmp_path):
    with pytest.raises(ValueError, match="synchronous but model.staleness=3"):
        main(["grpo", *_small(tiny_llm_dir, tmp_path), "--method", "sync", "--model.staleness", "3"])
    with pytest.raises(ValueError, match="unknown method"):
        main(["grpo", *_small(tiny_llm_dir, tmp_path), "--method", "nope"])
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        main(["grpo", *_small(tiny_llm_dir, tmp_path), "--ckpt_path", "last", "--trainer.max_steps", "1"])


def test_rollout_bench_writes_engines_side_by_side(tiny_llm_dir, tmp_path, capsys):
    out = tmp_path / "rb.json"
    assert main(["rollout-bench", "--engines", "hf", "--model", tiny_llm_dir, "--prompts", "4", "--group", "2",
                 "--max-tokens", "4", "--repeats", "2", "--grpo-steps", "2", "--grpo-prompts", "2", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    hf = rec["engines"]["hf"]
    assert len(hf["tokens_per_s_all"]) == 2 and hf["tokens_per_s_median"] > 0
    assert 0.0 < hf["grpo"]["generate_share"] < 1.0


def _byte_bpe_checkpoint(path: Path, texts: list[str]) -> str:
    """A tiny Qwen3 with a byte-level BPE tokenizer trained on ``texts``: a stand-in for a real checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

    from gacbench.llm.model import tiny_config

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<bos>", "<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    Qwen3ForCausalLM(tiny_config(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=128, max_len=256,
                                 vocab=fast.vocab_size)).save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def test_grpo_on_a_local_math_dataset_with_a_real_tokenizer(tmp_path):
    pytest.importorskip("math_verify")
    from conftest import make_trainer

    from gacbench.llm.grpo import GRPOModule

    data = ROOT / "tasks/math/example.jsonl"
    texts = [line for line in data.read_text().splitlines() if line.strip()]
    model_dir = _byte_bpe_checkpoint(tmp_path / "bpe", texts)
    m = GRPOModule(model_dir, task=str(data), eval_fraction=0.25, prompts=2, group=3, max_tokens=6, steps=2, eval_size=4,
                   template="Problem: {problem}\nAnswer: ")
    assert m.reward.__name__ == "math_verify_reward"
    trainer = make_trainer([], max_steps=2)
    trainer.fit(m)
    assert trainer.logger.values("stale/lag") == [0.0, 0.0] and len(trainer.logger.values("reward/mean")) == 2
    with pytest.raises(ValueError, match="Set model_path to a local checkpoint"):
        GRPOModule(None, task=str(data))
    with pytest.raises(ValueError, match="exceeds the model's context of 256"):  # checked for every row up front
        GRPOModule(model_dir, task=str(data), eval_fraction=0.25, max_tokens=250)
