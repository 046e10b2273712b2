"""The tiny Qwen3 model and its tokenizer, built from a config with nothing downloaded.

``build_tokenizer()`` makes a character-level ``PreTrainedTokenizerFast`` (digits, ``+-*=``, newline,
and pad/bos/eos); ``tiny_config()`` a small ``Qwen3Config`` (head_dim 32: vLLM's CPU attention
rejects 16); ``cached_model_dir(config)`` builds, initialises (seeded) and saves model + tokenizer
under a cache directory keyed by a hash of the config, once; ``load(path)`` is the one loading path
for that directory and for any local Hugging Face checkpoint (e.g. Qwen3-1.7B on a GPU machine).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = list("0123456789+-*=\n")


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def completion_text(tok, ids, special: frozenset[int] | None = None) -> str:
    """The text a completion wrote, as a reward reads it: its tokens before the first end-of-sequence token, less
    the special tokens that end it (a batch's padding after the end, or another stop token of the model), decoded
    with every other special token kept: a ``<pad>`` or ``<bos>`` sampled inside a completion is part of what it
    wrote, so ``1<pad>2`` is not the answer 12. ``special``: the tokenizer's special ids, when the caller holds
    them (``frozenset(tok.all_special_ids)``)."""
    special = frozenset(tok.all_special_ids) if special is None else special
    ids = [int(i) for i in ids]
    if tok.eos_token_id in ids:
        ids = ids[: ids.index(tok.eos_token_id)]
    while ids and ids[-1] in special:
        ids.pop()
    return tok.decode(ids, skip_special_tokens=False)


def tiny_config(hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2, intermediate: int = 384,
                max_len: int = 64, vocab: int | None = None):
    from transformers import Qwen3Config

    if hidden % heads or heads % kv_heads:
        raise ValueError(f"tiny_config: hidden={hidden} must be divisible by heads={heads}, and heads by "
                         f"kv_heads={kv_heads}")
    head_dim = hidden // heads
    if head_dim < 32:
        raise ValueError(f"tiny_config: head_dim = hidden/heads = {head_dim}; vLLM's CPU attention needs "
                         "head_dim >= 32")
    return Qwen3Config(vocab_size=vocab or len(SPECIALS) + len(CHARS), hidden_size=hidden,
                       intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim,
                       max_position_embeddings=max_len, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


#: Named architectures for ``model.size`` (GRPO's ModelConfig): keyword arguments of :func:`tiny_config`.
#: ``tiny``: hidden 128, 4 layers, 0.79M parameters; ``small``: hidden 256, 6 layers, 8 heads of 32 (vLLM's CPU
#: attention needs head_dim >= 32), 4.7M parameters; ``medium``: hidden 384, 8 layers, 12 heads of 32, 17.3M
#: parameters.
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {},
    "small": {"hidden": 256, "layers": 6, "heads": 8, "kv_heads": 4, "intermediate": 768},
    "medium": {"hidden": 384, "layers": 8, "heads": 12, "kv_heads": 4, "intermediate": 1536},
}


def sized_config(size: str = "tiny"):
    """The ``Qwen3Config`` of a named size (:data:`MODEL_SIZES`)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"model.size={size!r} is not one of {', '.join(MODEL_SIZES)} (gacbench.llm.model.MODEL_SIZES)")
    return tiny_config(**MODEL_SIZES[size])


_VOLATILE = {"architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "output_attentions"}


def config_key(config) -> str:
    """A hash of the architecture (save_pretrained adds bookkeeping fields; they are left out)."""
    fields = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("GACBENCH_CACHE", Path.home() / ".cache" / "gacbench"))


def cached_model_dir(config=None, cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """The directory of the (freshly initialised) tiny model for ``config``; built once, then reused."""
    from transformers import Qwen3ForCausalLM

    config = config or tiny_config()
    path = Path(cache_dir or default_cache_dir()) / f"tiny-qwen3-{config_key(config)}-seed{seed}"
    if (path / "config.json").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(tmp)
    build_tokenizer().save_pretrained(tmp)
    install_dir(tmp, path)
    return path


def install_dir(tmp: Path, path: Path, tries: int = 5) -> None:
    """Move the finished checkpoint directory ``tmp`` to ``path`` (a cache entry) by a rename. A complete entry
    (it holds a config.json) that another process installed meanwhile, before the check or between the check and
    the rename, is kept and ``tmp`` deleted; an incomplete one (no config.json: a copy cut short) is moved aside,
    deleted and replaced, so that it is not returned for ever."""
    import errno
    import shutil

    for _ in range(tries):
        if (path / "config.json").exists():
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if path.exists():
            aside = path.with_name(f"{path.name}.incomplete{os.getpid()}")
            try:
                os.replace(path, aside)
            except OSError:
                continue  # another process moved or completed it meanwhile: look again
            shutil.rmtree(aside, ignore_errors=True)
        try:
            os.replace(tmp, path)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    raise RuntimeError(f"{path}: could not install the checkpoint built in {tmp} after {tries} tries (other "
                       "processes kept replacing it); delete both and run again")


def check_checkpoint_option(option: str, path: str | os.PathLike) -> None:
    """A UsageError naming ``option`` unless ``path`` is a local checkpoint directory (it holds a config.json)."""
    from gacbench.usage import UsageError

    if not (Path(path) / "config.json").is_file():
        raise UsageError(f"{option} {path}: not a local Hugging Face checkpoint directory (no config.json); give a "
                         f"directory written by save_pretrained, or leave {option} unset for the built-in model")


def load(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local checkpoint directory; a clear error if it is not one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(
            f"model path {p} is not a local Hugging Face checkpoint directory (no config.json). Give a directory "
            "written by save_pretrained (e.g. a downloaded Qwen3-1.7B), or leave the model path unset to build the "
            "tiny model."
        )
    from transformers.utils import logging as hf_logging

    from gacbench.usage import UsageError

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per load would fill a grid's log
    fix = ("Give a directory written by save_pretrained (config.json, the weights and the tokenizer files), or leave "
           "the model path unset to build the tiny model.")
    try:
        model, tok = AutoModelForCausalLM.from_pretrained(p, dtype=dtype), AutoTokenizer.from_pretrained(p)
    except Exception as exc:  # a damaged config.json, no weights, cut-off weights (safetensors' own error), ...
        reason = " ".join(str(exc).split())[:300]
        raise UsageError(f"model path {p} has a config.json but cannot be loaded as a Hugging Face checkpoint "
                         f"({type(exc).__name__}: {reason}). {fix}") from exc
    if not tok.encode("1", add_special_tokens=False):  # what transformers builds from no tokenizer files at all
        raise UsageError(f"model path {p}: its tokenizer encodes text to no tokens (no tokenizer files?). {fix}")
    if tok.pad_token_id is None:  # many released checkpoints have none; padding positions are masked anyway
        tok.pad_token = tok.eos_token
    rows = model.get_input_embeddings().weight.shape[0]
    special = {name: getattr(tok, f"{name}_token_id") for name in ("eos", "pad", "bos", "unk")}
    outside = {name: i for name, i in special.items() if isinstance(i, int) and i >= rows}
    if outside:  # an unused extra token beyond the rows is fine (some released tokenizers have one); these are read
        raise UsageError(f"model path {p}: its tokenizer's " + ", ".join(f"{n} token {i}" for n, i in outside.items())
                         + f" lies beyond the model's {rows} embedding rows: the tokenizer files do not belong to this "
                         f"model, or some are missing (e.g. tokenizer_config.json). {fix}")
    return model, tok


@dataclass(frozen=True)
class Qwen3Shape:
    """The parameter shapes of a Qwen3 decoder (tied embeddings)."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def shapes(self) -> list[tuple[int, ...]]:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out: list[tuple[int, ...]] = [(self.vocab, h)]
        for _ in range(self.layers):
            out += [(q, h), (kv, h), (kv, h), (h, q), (self.head_dim,), (self.head_dim,)]  # attention, q/k norms
            out += [(self.intermediate, h), (self.intermediate, h), (h, self.intermediate)]  # gate, up, down
            out += [(h,), (h,)]  # input and post-attention RMSNorm
        out.append((h,))  # final norm
        return out

    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes())

    @classmethod
    def of_config(cls, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                  vocab: int) -> Qwen3Shape:
        """The shape of the model :func:`tiny_config` builds from these arguments (head_dim = hidden / heads)."""
        return cls(hidden=hidden, layers=layers, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                   head_dim=hidden // heads, vocab=vocab)
