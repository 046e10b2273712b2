"""Pinned start points: the warm-started checkpoints (θ₀) the shipped LLM suites start from, shipped as files.

A warm start is a short supervised run (:mod:`gacbench.llm.warmstart`); its float rounding depends on the CPU's
kernels, so two instruction sets (AVX2, AVX-512) build checkpoints that differ in their last bits, and GRPO runs
from them differ from the first step on by more than the effects the grids measure. Each start point a shipped
suite uses is therefore built once, shipped under ``tasks/models/<name>/`` (fp32 safetensors, as
``save_pretrained`` writes it) and identified by :func:`gacbench.provenance.weights_sha256` of that directory:

- :func:`resolve` returns the shipped directory when it is present (its hash checked once per process);
- where it is absent (an installed wheel without the repository, or another ``GACBENCH_MODELS``), the warm start
  is built as before and must hash to the pin, else the run is refused in one line that names both hashes;
- a warm start with no pin (other sizes, steps or task settings) is built and cached as before;
- the configuration, tokenizer and generation config are pinned beside the weights (:data:`PINNED_SPEC`,
  :func:`spec_sha256`): the pinned weights with another config.json, vocabulary or end token are refused too.

``gacbench warm-start`` rebuilds a warm start from scratch and prints its hash beside the pin.
"""

from __future__ import annotations

import os
from pathlib import Path

from gacbench.provenance import weights_sha256
from gacbench.usage import UsageError

#: warm-start directory name (:func:`gacbench.llm.warmstart.warm_key`) -> SHA-256 of its weight files. Each was
#: built by ``gacbench warm-start`` on an Intel Xeon (AVX-512, torch 2.13.0+cpu); sizes: tiny 3.2 MB, small
#: 18.9 MB (arithmetic, 400 steps; scratchpad, 500 steps), medium 69.3 MB. The stored grids that predate the pins
#: (llm-headline, llm-size, llm-length, ...) started from other builds: docs/bench.md says which.
PINNED: dict[str, str] = {
    "warm-ScratchpadTask-e5c7a350526619cd-min_ops3-max_ops3-max_operand9-eval_fraction0.1-seed0-sft500-seed0":
        "e662ea31a73b47427001aebb3f8f1bcb24f956e1a728127c749d745944d972b5",
    "warm-b41bac11619e2889-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0":
        "e9b89f85285d8e61ad445d62d6ed7ede27c31efe0f42afed3c7b16384cbe962e",
    "warm-dd5cd00b44e5fa65-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0":
        "960d2fd6ed046d6e4dfa8e10d590859ca9790e7955e45319e1a7cb72cde14c1c",
    "warm-e5c7a350526619cd-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0":
        "2baca9ffd0b07cff32debef4f588a43ae769ea040b19ced1654a3dd6f09dc714",
}

def transformers_too_old() -> str | None:
    """transformers' version where it is older than 5, else None. The start points' names (:data:`PINNED`'s keys,
    :func:`gacbench.llm.warmstart.warm_key`) hash the model configuration as transformers 5 serialises it, and
    the shipped tokenizers name transformers 5's tokenizer class, so under transformers 4 no start point finds
    its pin."""
    from importlib import metadata

    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None
    return version if int(version.split(".")[0]) < 5 else None


#: the machine that built the pins (their rounding is its kernels')
PINNED_ON = "an Intel Xeon (GenuineIntel, instruction set AVX512, torch 2.13.0+cpu)"

#: the configuration attributes that decide what a checkpoint computes, read by :func:`spec_sha256`
SPEC_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
             "rms_norm_eps", "tie_word_embeddings", "attention_bias", "use_sliding_window", "sliding_window",
             "bos_token_id", "eos_token_id", "pad_token_id")

#: warm-start directory name -> :func:`spec_sha256` of its configuration, tokenizer and end tokens: the weights
#: hash alone would accept a copy whose config.json (rope_theta, say) or vocabulary was changed, or a build from a code
#: version whose configuration computes differently with the same weights.
PINNED_SPEC: dict[str, str] = {
    "warm-ScratchpadTask-e5c7a350526619cd-min_ops3-max_ops3-max_operand9-eval_fraction0.1-seed0-sft500-seed0":
        "fe3888b9f0ad2342ea66aad69f756f9d1f5a7be96758c4ae4c257d0975a2b46a",
    "warm-b41bac11619e2889-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0":
        "bbf21b5902d0a617ae5b7d181b1b03e94d511268db38fea45f8a09c1a5eeab62",
    "warm-dd5cd00b44e5fa65-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0":
        "4eaa56f053480509583cdc31da747a42e4ca9cc7dcab69fbe6be73c8b73764c8",
    "warm-e5c7a350526619cd-max_ops2-max_operand9-eval_fraction0.1-seed0-sft400-seed0":
        "fe3888b9f0ad2342ea66aad69f756f9d1f5a7be96758c4ae4c257d0975a2b46a",
}

_checked: dict[Path, str] = {}
_checked_spec: dict[Path, str] = {}


def spec_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of what a checkpoint directory computes besides its weights, read as transformers reads it (so that
    the serialisation of one transformers version or another does not matter): the :data:`SPEC_KEYS` of its
    configuration, its rotary base, its tokenizer's vocabulary and special tokens, and the token ids of its
    generation config (``generation_config.json``; the rollout engines and the greedy evaluation end a completion
    at its ``eos_token_id``), null where it has none."""
    import hashlib
    import json

    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path))
    spec = {k: getattr(config, k, None) for k in SPEC_KEYS}
    rope = getattr(config, "rope_parameters", None) or {}  # transformers 5: rope_parameters; 4: rope_theta
    spec["rope_theta"] = float(rope.get("rope_theta", getattr(config, "rope_theta", 0.0)) or 0.0)
    tok = AutoTokenizer.from_pretrained(str(path))
    spec["vocab"] = sorted(tok.get_vocab().items())
    spec["special"] = [tok.bos_token, tok.eos_token, tok.pad_token]
    generation = Path(path) / "generation_config.json"
    if generation.is_file():
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(str(path))
        spec["generation"] = {k: getattr(gen, k, None) for k in ("eos_token_id", "bos_token_id", "pad_token_id")}
    else:
        spec["generation"] = None
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def models_root() -> Path:
    """Where pinned checkpoints are looked for: ``$GACBENCH_MODELS``, else the repository's ``tasks/models``."""
    env = os.environ.get("GACBENCH_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "tasks" / "models"


def pin_of(name: str) -> str | None:
    """The pinned SHA-256 of the warm-start directory ``name``, or None when it has no pin."""
    return PINNED.get(name)


def shipped_dir(name: str) -> Path | None:
    """The shipped checkpoint directory of a pinned warm start, or None when it is not on disk."""
    path = models_root() / name
    return path if PINNED.get(name) and (path / "config.json").exists() else None


def check(name: str, path: Path) -> str:
    """The weights hash of ``path``; refuses (UsageError) when ``name`` is pinned and the hash differs, or when its
    configuration, tokenizer and end tokens (:func:`spec_sha256`) differ from the pinned ones."""
    path = Path(path)
    if path not in _checked:
        _checked[path] = weights_sha256(path)
    digest, pin = _checked[path], PINNED.get(name)
    shipped = path.resolve() == (models_root() / name).resolve()
    if pin is not None and digest != pin:
        from gacbench.provenance import WEIGHT_PATTERNS, cpu_description

        if shipped:  # the shipped files themselves: damaged or edited, not another machine's rounding
            files = sorted({f.name for pattern in WEIGHT_PATTERNS for f in path.glob(pattern) if f.is_file()})
            raise UsageError(
                f"start point {name}: the shipped checkpoint {path} has weights SHA-256 {digest[:16]}... over "
                f"{', '.join(files)}, the pin is {pin[:16]}...: a damaged or edited copy (a weight file changed, or "
                f"another *.bin/*.pt/*.safetensors file added); {_restore(path, name)}, and remove files that are "
                "not the checkpoint's, or give model.path to run from another start point on purpose")
        cpu = cpu_description()
        raise UsageError(
            f"start point {name}: {path}, built on this machine ({cpu.get('cpu_vendor') or 'unknown vendor'}, "
            f"instruction set {cpu.get('isa', 'unknown')}), has weights SHA-256 {digest[:16]}..., the pinned θ₀ "
            f"is {pin[:16]}... (built on {PINNED_ON}, whose kernels round the warm start differently); use the "
            f"shipped checkpoint ({models_root() / name}: run from a checkout of the repository, or set "
            "GACBENCH_MODELS to a directory that holds it), or give model.path to run from another start point on "
            "purpose")
    spec_pin = PINNED_SPEC.get(name)
    if spec_pin is not None:
        if path not in _checked_spec:
            try:
                _checked_spec[path] = spec_sha256(path)
            except (OSError, ValueError) as exc:  # a truncated config.json or tokenizer.json, a missing file
                raise UsageError(f"start point {name}: {path}'s config.json, tokenizer or generation_config.json "
                                 f"cannot be read ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); "
                                 f"{_restore(path, name)}") from None
        if _checked_spec[path] != spec_pin:
            raise UsageError(
                f"start point {name}: {path} has the pinned weights, but its config.json, tokenizer or "
                f"generation_config.json computes otherwise (their SHA-256 {_checked_spec[path][:16]}..., pinned "
                f"{spec_pin[:16]}...): an edited copy, or a build by another code version; use the shipped "
                f"checkpoint ({models_root() / name}), or give model.path to run from another start point on purpose")
    return digest


def _restore(path: Path, name: str) -> str:
    """How to put a damaged start point directory back: from git where it is the repository's own copy, else from
    that copy."""
    repo = Path(__file__).resolve().parents[2]
    own = repo / "tasks" / "models" / name
    if path.resolve() == own.resolve() and (repo / ".git").exists():
        return f"restore it (git -C {repo} checkout -- tasks/models/{name})"
    return f"copy it again from the repository's tasks/models/{name}"


def resolve(name: str, build) -> Path:
    """The checkpoint directory of warm start ``name``: the shipped one if present, else ``build()``'s, checked
    against the pin."""
    shipped = shipped_dir(name)
    path = shipped if shipped is not None else Path(build())
    if name in PINNED:  # an unpinned start point is used as built, unhashed
        check(name, path)
    return path
