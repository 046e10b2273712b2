"""The LLM side of gacbench: GRPO with rollout engines, a procedural arithmetic task with exact-answer
rewards, a character-level tokenizer and a tiny Qwen3-architecture model built from a config,
cached on disk, loaded through the same ``from_pretrained`` path as any local checkpoint."""

from gacbench.objectives.registry import register_objective

register_objective("grpo", "gacbench.llm.grpo:GRPOModule")  # imported on first use (needs transformers)
