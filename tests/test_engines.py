"""Rollout engines: the registry, the per-process cache, the batched HF engine and the vLLM weight sync.

The reuse tests check the contract that makes the cache safe: a cell's rollouts depend only on its
weights, prompts and seeds, bit for bit, whether its engine was built for it or reused after other cells.
"""

import contextlib
import copy

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from gacbench.llm.model import cached_model_dir, load, tiny_config  # noqa: E402
from gacbench.llm.task import ArithmeticTask  # noqa: E402
from gacbench.rollout import engines as E  # noqa: E402

SMALL = dict(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=128)


@pytest.fixture
def small(tmp_path):
    """(checkpoint dir, model, tokenizer) of a freshly initialised small tiny Qwen3."""
    d = cached_model_dir(tiny_config(**SMALL), tmp_path)
    model, tok = load(d)
    return str(d), model, tok


@pytest.fixture(autouse=True)
def no_cached_engines():
    """Every test starts and ends with an empty engine cache."""
    E.release_engines()
    yield
    E.release_engines()


def _prompts(tok, k=4, split="train", **task):
    return [tok.encode(p.prompt, add_special_tokens=False) for p in ArithmeticTask(**task).batch(split, 0, k)]


def _perturb(model, scale=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def _flat(groups):
    return [(r.completion_ids, r.logprobs) for g in groups for r in g]


def _inputs(model_path, model, tok, **kw):
    return {"model_path": model_path, "policy": model, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "max_model_len": 64, **kw}


# -- the registry ---------------------------------------------------------------------------------------
class _Fake:
    needs_sync_check = False

    def __init__(self, spec, seed):
        self.spec, self.seed, self.version, self.closed = spec, seed, 0, False

    def generate(self, prompts, n, max_tokens, seed):
        return []

    def load_weights(self, state_dict, version):
        self.version = version

    def close(self):
        self.closed = True


@pytest.fixture
def fake_engine():
    built = []

    @E.register_engine("fake")
    def _build(spec, *, model_path, policy, eos_token_id, pad_token_id, max_model_len, seed):
        built.append(_Fake(spec, seed))
        return built[-1]

    yield built
    E.release_engines()
    E.ENGINES.pop("fake")


def test_registry_lists_hf_and_vllm_and_refuses_unknown_or_duplicate_names(small, fake_engine):
    d, model, tok = small
    assert {"hf", "vllm"} <= set(E.engine_names()) and "fake" in E.engine_names()
    with pytest.raises(ValueError, match=r"unknown rollout engine 'sglang'; registered engines: fake, hf, vllm"):
        E.build_engine("sglang", **_inputs(d, model, tok))
    with pytest.raises(ValueError, match="unknown rollout engine 'sglang'"):
        E.acquire_engine(E.EngineSpec("sglang"), **_inputs(d, model, tok))
    with pytest.raises(ValueError, match="already registered"):
        E.register_engine("hf", lambda spec, **kw: None)
    engine = E.build_engine(E.EngineSpec("fake", dtype="bfloat16"), **_inputs(d, model, tok, seed=3))
    assert isinstance(engine, _Fake) and engine.spec.dtype == "bfloat16" and engine.seed == 3
    assert isinstance(E.build_engine("hf", **_inputs(d, model, tok)), E.HFEngine)


def test_the_cache_reuses_an_engine_for_an_equal_key_and_replaces_it_otherwise(small, fake_engine):
    d, model, tok = small
    first = E.acquire_engine(E.EngineSpec("fake"), **_inputs(d, model, tok, seed=0))
    first.load_weights({}, 7)
    again = E.acquire_engine(E.EngineSpec("fake"), **_inputs(d, model, tok, seed=1))  # another seed: same engine
    assert again is first and len(fake_engine) == 1
    assert again.version == E.UNSYNCED  # until the caller loads its weights
    other = E.acquire_engine(E.EngineSpec("fake", kv_cache_gib=0.5), **_inputs(d, model, tok))
    assert other is not first and first.closed and not other.closed  # one engine per name at a time
    assert E.cached_engine("fake") is other
    bigger, _ = load(cached_model_dir(tiny_config(**{**SMALL, "layers": 3}), d + "-other"))
    third = E.acquire_engine(E.EngineSpec("fake", kv_cache_gib=0.5), **_inputs(d, bigger, tok))  # other architecture
    assert third is not other and other.closed
    wider = E.acquire_engine(E.EngineSpec("fake", kv_cache_gib=0.5), **_inputs(d, copy.deepcopy(bigger).double(), tok))
    assert wider is not third and third.closed  # the policy's dtype differs
    third = E.acquire_engine(E.EngineSpec("fake", kv_cache_gib=0.5), **_inputs(d, bigger, tok, max_model_len=32))
    assert third is not wider and wider.closed  # the context differs
    compiled = E.acquire_engine(E.EngineSpec("fake", kv_cache_gib=0.5, compile=True),
                                **_inputs(d, bigger, tok, max_model_len=32))
    assert compiled is not third and third.closed  # a compiled forward is another engine
    third = E.acquire_engine(E.EngineSpec("fake", kv_cache_gib=0.5), **_inputs(d, bigger, tok, max_model_len=32))
    assert third is not compiled and compiled.closed
    ends = E.acquire_engine(E.EngineSpec("fake", kv_cache_gib=0.5),
                            **_inputs(d, bigger, tok, max_model_len=32, eos_token_id=tok.eos_token_id + 7))
    assert ends is not third and third.closed  # another end token: the engine stops elsewhere
    third = E.acquire_engine(E.EngineSpec("fake", kv_cache_gib=0.5), **_inputs(d, bigger, tok, max_model_len=32))
    assert third is not ends and ends.closed
    E.release_engines("fake")
    assert third.closed and E.cached_engine("fake") is None
    broken = E.acquire_engine(E.EngineSpec("fake"), **_inputs(d, model, tok))
    E.discard_engine(broken)  # after a failure: closed, and never handed out again
    assert broken.closed and E.cached_engine("fake") is None
    assert E.acquire_engine(E.EngineSpec("fake"), **_inputs(d, model, tok)) is not broken


# -- hf ------------------------------------------------------------------------------------------------
def test_hf_engine_generates_every_prompt_in_one_padded_batch_with_exact_log_probs(small):
    d, model, tok = small
    _perturb(model, 0.5)  # a less uniform policy: completions of different lengths, some ending in eos
    prompts = _prompts(tok, 6, max_ops=3, max_operand=99)
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    engine = E.HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    calls = []
    generate = engine.model.generate
    engine.model.generate = lambda *a, **k: calls.append(a[0].shape) or generate(*a, **k)
    state = torch.random.get_rng_state()
    groups = engine.generate(prompts, n=5, max_tokens=6, seed=11)
    assert calls == [(30, max(len(p) for p in prompts))]  # one call, prompts x samples rows
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is untouched
    assert [len(g) for g in groups] == [5] * 6
    lengths = set()
    for prompt, group in zip(prompts, groups):
        for r in group:
            assert r.prompt_ids == prompt and len(r.logprobs) == len(r.completion_ids) >= 1
            ids = r.completion_ids
            assert tok.eos_token_id not in ids[:-1]  # cut at the first eos, which is kept
            assert ids[-1] == tok.eos_token_id or len(ids) == 6
            lengths.add(len(ids))
            ref = sequence_logprobs_unpadded(model, r)
            # float32 sums of a padded batch and of one row round apart (up to 1.05e-5 seen with some CPUs' kernels)
            assert (ref - torch.tensor(r.logprobs)).abs().max() < 5e-5
    assert len(lengths) > 1
    assert any(r.completion_ids[-1] == tok.eos_token_id for g in groups for r in g)
    assert _flat(engine.generate(prompts, n=5, max_tokens=6, seed=11)) == _flat(groups)  # seeded
    assert _flat(engine.generate(prompts, n=5, max_tokens=6, seed=12)) != _flat(groups)
    # the prompts were encoded once each (a cache of 6 rows, repeated to 30), and that changes nothing: generate
    # encoding all 30 rows itself samples the same tokens with the same log-probs
    shared, seen = engine._prompt_cache, []

    def spy(ids, attention, n):
        cache = shared(ids, attention, n)
        seen.append((ids.shape[0], n, cache.get_seq_length()))  # before generate extends it
        return cache

    engine._prompt_cache = spy
    engine.generate(prompts, n=5, max_tokens=6, seed=11)
    assert seen == [(6, 5, max(len(p) for p in prompts) - 1)]
    engine._prompt_cache = lambda *a: None
    plain = engine.generate(prompts, n=5, max_tokens=6, seed=11)
    for g, h in zip(groups, plain):
        for r, q in zip(g, h):
            assert r.completion_ids == q.completion_ids
            assert max(abs(a - b) for a, b in zip(r.logprobs, q.logprobs)) < 1e-5


def test_hf_engine_samples_the_policy_whatever_sampling_settings_the_checkpoint_carries(small):
    """A checkpoint's generation_config.json may set a repetition penalty, top-k, top-p, a temperature and extra
    end tokens (Qwen's lists two): the engine's samples and log-probs are the policy's all the same, and a
    completion ends at any of the end tokens, as vLLM's do."""
    d, model, tok = small
    _perturb(model, 0.5)
    seven = tok.convert_tokens_to_ids("7")
    model.generation_config.update(repetition_penalty=1.3, temperature=0.7, top_p=0.8, top_k=20,
                                   no_repeat_ngram_size=2, eos_token_id=[tok.eos_token_id, seven])
    engine = E.HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    assert model.generation_config.repetition_penalty == 1.3  # the trainer's own model is left as it was
    prompts = _prompts(tok, 6, max_ops=3, max_operand=99)
    assert E.check_sync(engine, model, prompts, tol=5e-5) < 5e-5
    rows = [r for g in engine.generate(prompts, n=8, max_tokens=8, seed=3) for r in g]
    for r in rows:
        assert (sequence_logprobs_unpadded(model, r) - torch.tensor(r.logprobs)).abs().max() < 5e-5
        assert not {tok.eos_token_id, seven} & set(r.completion_ids[:-1])  # cut at the first end token, kept
    assert any(r.completion_ids[-1] == seven for r in rows)


def sequence_logprobs_unpadded(model, r):
    with torch.no_grad():
        return E.sequence_logprobs(model, r.prompt_ids, r.completion_ids)


def test_hf_engine_follows_the_trainer_after_a_weight_sync(small):
    d, model, tok = small
    engine = E.HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    prompts = _prompts(tok)
    assert not engine.needs_sync_check and E.check_sync(engine, model, prompts) < 1e-5
    _perturb(model)  # the trainer moves on: the engine is now stale, and the check notices
    with pytest.raises(RuntimeError, match="weight sync failed"):
        E.check_sync(engine, model, prompts)
    engine.load_weights(model.state_dict(), version=1)
    assert engine.version == 1 and E.check_sync(engine, model, prompts) < 1e-5
    assert all(r.version == 1 for g in engine.generate(prompts, n=3, max_tokens=6, seed=5) for r in g)


def test_hf_rollouts_are_bit_identical_from_a_fresh_or_a_reused_engine(small):
    d, model, tok = small
    cell_a = {k: v.clone() for k, v in model.state_dict().items()}
    prompts = _prompts(tok, 4, max_ops=3, max_operand=99)
    spec = E.EngineSpec("hf")
    fresh = E.acquire_engine(spec, **_inputs(d, model, tok, seed=0))
    fresh.load_weights(model.state_dict(), 0)
    expected = fresh.generate(prompts, n=4, max_tokens=6, seed=21)
    # another cell in the same process: other weights, other seeds
    _perturb(model, 0.3, seed=1)
    engine = E.acquire_engine(spec, **_inputs(d, model, tok, seed=5))
    assert engine is fresh and engine.version == E.UNSYNCED
    engine.load_weights(model.state_dict(), 0)
    other = engine.generate(prompts, n=4, max_tokens=6, seed=3)
    assert _flat(other) != _flat(expected)
    # the first cell again, on the reused engine
    model.load_state_dict(cell_a)
    engine = E.acquire_engine(spec, **_inputs(d, model, tok, seed=0))
    assert engine is fresh
    engine.load_weights(model.state_dict(), 0)
    assert _flat(engine.generate(prompts, n=4, max_tokens=6, seed=21)) == _flat(expected)


def test_hf_engine_under_bf16_autocast_casts_its_linear_weights_once_per_call_with_autocasts_rollouts(
        small, monkeypatch):
    """Autocast casts the engine copy's float32 linear weights at every forward (they do not require grad, so it
    caches nothing); the engine casts them once per call instead, and samples the same tokens and log-probs bit
    for bit as an engine that leaves the casts to autocast."""
    d, model, tok = small
    prompts = _prompts(tok)
    cached = E.HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    per_step = E.HFEngine(model, tok.eos_token_id, tok.pad_token_id)
    monkeypatch.setattr(per_step, "_autocast_linears", lambda device: contextlib.nullcontext())
    linears = [p for m in model.modules() if type(m) is torch.nn.Linear for p in m.parameters()]
    shapes = {tuple(p.shape) for p in linears}

    def run(engine, seed):
        """The rollouts, and the casts of weight-shaped tensors while generating."""
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.profiler.profile(record_shapes=True) as prof:
            groups = engine.generate(prompts, n=3, max_tokens=8, seed=seed)
        casts = sum(1 for ev in prof.events() if ev.name == "aten::_to_copy" and ev.input_shapes
                    and tuple(ev.input_shapes[0]) in shapes)
        return _flat(groups), casts

    before = None
    for version in (0, 1):
        if version:
            _perturb(model)
            for engine in (cached, per_step):
                engine.load_weights(model.state_dict(), version)
        got, casts = run(cached, 4)
        want, autocasts = run(per_step, 4)
        assert got == want and got != before  # the casts follow the loaded weights
        assert casts == len(linears) and autocasts >= 2 * len(linears)  # once, against once per forward
        before = got
    head = cached.model.get_output_embeddings().weight  # the copy's own parameters are back, tied and float32
    assert head is cached.model.get_input_embeddings().weight and head.dtype == torch.float32


# -- vllm ----------------------------------------------------------------------------------------------
def _adamw_steps(model, prompts, steps, lr=3e-3):
    """Optimizer-like updates: AdamW steps on a language-modelling loss, every parameter moves."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.tensor([prompts[0] + prompts[1]])
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def _vllm_model(engine):
    return engine.llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()


def _assert_synced_in_place(engine, model, before=None):
    """Every linear layer of the engine computes with F.linear on its own full weight, which holds the trainer's
    tensors exactly (q/k/v and gate/up stacked as rows); a sync copied into the same tensors (``before``: their
    data pointers at an earlier sync). Returns the data pointers."""
    vm, sd = _vllm_model(engine), model.state_dict()
    layers = {n: m for n, m in vm.named_modules() if hasattr(m, "cpu_linear")}
    assert layers and all(m.cpu_linear is torch.nn.functional.linear for m in layers.values())
    qkv = [m for n, m in layers.items() if n.endswith("layers.0.self_attn.qkv_proj")][0]
    pre = "model.layers.0.self_attn."
    assert torch.equal(qkv.weight, torch.cat([sd[pre + "q_proj.weight"], sd[pre + "k_proj.weight"],
                                              sd[pre + "v_proj.weight"]]))
    emb = sd["model.embed_tokens.weight"]
    assert torch.equal(vm.model.embed_tokens.weight[: emb.shape[0]], emb)  # the tied head reads the same tensor
    assert set(sd) - set(engine._direct.sources) <= {"lm_head.weight"}  # a tied head is the embedding
    ptrs = [t.data_ptr() for t in engine._direct.targets]
    assert before is None or ptrs == before
    return ptrs


def test_the_sampled_tokens_ranks_are_counted_eagerly_with_vllms_integers(monkeypatch):
    """vLLM's sampler ranks each sampled token by counting the row's entries >= its log-prob; on the CPU the engine
    counts eagerly where the vocabulary is narrow (the same integers: ties included, the sampled token counts
    itself) and leaves wider rows to vLLM's compiled count."""
    pytest.importorskip("vllm")
    from vllm.v1.sample import sampler

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 50, generator=g).round(decimals=1)  # many ties
    picked = torch.randint(0, 50, (37, 1), generator=g)
    values = x.gather(1, picked)
    ranks = E._count_at_least(x, values)
    expected = torch.tensor([sum(1 for v in row if v >= val) for row, val in zip(x.tolist(), values[:, 0].tolist())])
    assert ranks.dtype == torch.int64 and torch.equal(ranks, expected) and bool((ranks >= 1).all())

    wide_calls = []

    def compiled(x, values):  # stands for vLLM's compiled count
        wide_calls.append(x.shape[-1])
        return E._count_at_least(x, values)

    monkeypatch.setattr(sampler, "batched_count_greater_than", compiled)
    E._eager_sampled_ranks()
    E._eager_sampled_ranks()  # wraps once
    count = sampler.batched_count_greater_than
    assert count is not compiled and count.eager_below == E.EAGER_RANK_VOCAB
    assert torch.equal(count(x, values), expected) and wide_calls == []
    wide = torch.randn(3, E.EAGER_RANK_VOCAB + 1, generator=g)
    assert torch.equal(count(wide, wide[:, :1]), E._count_at_least(wide, wide[:, :1]))
    assert wide_calls == [E.EAGER_RANK_VOCAB + 1]


def test_vllm_compile_is_refused_where_the_weights_cannot_be_synced_in_place(small):
    """A compiled forward keeps the kernels it traced: compile=True needs the in-place (direct) sync of a float32
    engine, refused before anything starts."""
    d, _, _ = small
    with pytest.raises(ValueError, match="compile=True needs the direct weight sync of a float32 engine"):
        E.VLLMEngine(d, compile=True, weight_sync="reload")
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        E.VLLMEngine(d, compile=True, dtype="bfloat16")


def test_vllm_syncs_refuse_a_state_dict_of_other_names_or_shapes_before_copying(small):
    """The direct copy would fill a shorter tensor's rows (a padded vocabulary's allowance) or broadcast a smaller
    one, and vLLM's reload skips names it does not know: the plan takes exact shapes but for the vocabulary, and a
    later sync must carry the first sync's names and shapes."""
    pytest.importorskip("vllm")
    d, model, tok = small
    prompts = _prompts(tok)
    sd = model.state_dict()
    norm = sd["model.norm.weight"]
    engine = E.VLLMEngine(d, max_model_len=64, seed=0, weight_sync="direct")
    try:
        with pytest.raises(RuntimeError, match=r"does not cover this model \(model.norm.weight: \(64,\) in the engine, "
                                               r"\(32,\) in the state dict\)"):
            engine.load_weights({**sd, "model.norm.weight": norm[:32]}, 1)
        _perturb(model)
        engine.load_weights(model.state_dict(), 1)  # the vocabulary embedding's padded rows are allowed
        assert engine.sync_method == "direct" and E.check_sync(engine, model, prompts, tol=1e-4) < 1e-4
        sd = model.state_dict()
        for bad, match in [({k: v for k, v in sd.items() if k != "model.norm.weight"}, "missing model.norm.weight"),
                           ({**sd, "extra.weight": norm}, "unexpected extra.weight"),
                           ({**sd, "model.norm.weight": norm[:1]}, r"mis-shaped model.norm.weight \(1,\) "
                                                                   r"\(expected \(64,\)\)")]:
            with torch.no_grad():
                model.model.norm.weight.add_(1.0)  # what a sync would carry: the engine must not take any of it
            with pytest.raises(ValueError, match=f"VLLMEngine.load_weights: {match}.*full state_dict"):
                engine.load_weights(bad, 2)
        assert engine.version == 1
        with torch.no_grad():
            model.model.norm.weight.sub_(3.0)
        assert E.check_sync(engine, model, prompts, tol=1e-4) < 1e-4
    finally:
        engine.close()


@pytest.mark.slow
def test_vllm_direct_sync_follows_the_trainer_and_reused_engines_give_identical_rollouts(small):
    """One engine serves three cells (direct weight sync: one fused copy into the engine's own weights, checked
    after several AdamW updates); a second engine, built with another seed and syncing through vLLM's reload
    (which packs the weights into oneDNN kernels again), samples the first cell's tokens with its log-probs to the
    last bits of float32."""
    pytest.importorskip("vllm")
    d, model, tok = small
    prompts = _prompts(tok)
    spec = E.EngineSpec("vllm")
    import random

    import numpy as np

    torch.manual_seed(123), random.seed(123), np.random.seed(123)
    engine = E.acquire_engine(spec, **_inputs(d, model, tok, seed=0))
    # vLLM seeds the global generators as it starts in this process: the caller's random state is put back, as a
    # reused engine leaves it
    assert (torch.rand(2).tolist(), random.random(), np.random.rand()) == (
        torch.manual_seed(123) and torch.rand(2).tolist(), random.seed(123) or random.random(),
        np.random.seed(123) or np.random.rand())
    assert engine.needs_sync_check and engine.version == 0
    assert not engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching  # no KV of old weights is reused
    cell_a = {k: v.clone() for k, v in model.state_dict().items()}
    engine.load_weights(model.state_dict(), 0)
    assert engine.sync_method == "direct", engine.sync_note
    ptrs = _assert_synced_in_place(engine, model)
    expected = engine.generate(prompts, n=4, max_tokens=6, seed=21)
    same = engine.generate([prompts[0]] * 2, n=4, max_tokens=6, seed=3)  # one prompt twice: independent samples
    assert [r.completion_ids for r in same[0]] != [r.completion_ids for r in same[1]]

    # cell B reuses the engine: several optimizer updates, each synced and checked
    engine_b = E.acquire_engine(spec, **_inputs(d, model, tok, seed=1))
    assert engine_b is engine and engine.version == E.UNSYNCED
    engine.load_weights(model.state_dict(), 0)
    for version in range(1, 5):
        _adamw_steps(model, prompts, 2)
        with pytest.raises(RuntimeError, match="weight sync failed"):
            E.check_sync(engine, model, prompts, tol=1e-4)  # the engine is stale until the sync
        engine.load_weights(model.state_dict(), version)
        assert E.check_sync(engine, model, prompts, tol=1e-4, seed=version) < 1e-4
        _assert_synced_in_place(engine, model, ptrs)
    assert engine.version == 4
    assert _flat(engine.generate(prompts, n=4, max_tokens=6, seed=21)) != _flat(expected)

    # cell A again on the reused engine
    model.load_state_dict(cell_a)
    assert E.acquire_engine(spec, **_inputs(d, model, tok, seed=0)) is engine
    engine.load_weights(model.state_dict(), 0)
    assert _flat(engine.generate(prompts, n=4, max_tokens=6, seed=21)) == _flat(expected)

    # a fresh engine, built with another seed, synced through vLLM's in-place reload
    E.release_engines()
    assert engine.llm is None
    reloading = E.VLLMEngine(d, max_model_len=64, seed=9, weight_sync="reload")
    try:
        reloading.load_weights(model.state_dict(), 0)
        assert reloading.sync_method == "reload"
        again = reloading.generate(prompts, n=4, max_tokens=6, seed=21)
        assert [r.completion_ids for g in again for r in g] == [r.completion_ids for g in expected for r in g]
        assert max(abs(a - b) for (_, x), (_, y) in zip(_flat(again), _flat(expected)) for a, b in zip(x, y)) < 1e-5
        _adamw_steps(model, prompts, 2)
        reloading.load_weights(model.state_dict(), 1)
        assert E.check_sync(reloading, model, prompts, tol=1e-4) < 1e-4
    finally:
        reloading.close()


def test_the_engine_core_route_is_taken_only_under_the_tested_vllm(monkeypatch):
    """The engine-core route reads vLLM internals of the tested version, with the engine core in this process;
    under any other version, or with the engine core in another process, generate goes through vLLM's front end
    with the same arguments."""
    vllm = pytest.importorskip("vllm")
    from vllm.v1.engine.core_client import InprocClient, SyncMPClient

    in_process, other_process = object.__new__(InprocClient), object.__new__(SyncMPClient)
    for version, route in [("0.32.0", "engine_core"), ("0.32.1", "engine_core"), ("0.33.0", "front_end"),
                           ("0.3.2", "front_end"), ("1.0.0", "front_end")]:
        monkeypatch.setattr(vllm, "__version__", version)
        assert E._generate_route(in_process) == route, version
        assert E._generate_route(other_process) == "front_end", version  # outputs of aborts, blocking reads
    calls = []
    monkeypatch.setattr(E, "front_end_generate", lambda *a: calls.append(a) or [["rollouts"]])
    engine = object.__new__(E.VLLMEngine)  # no engine started: the front-end route reads nothing else
    engine.route = "front_end"
    assert engine.generate([[1, 2]], n=3, max_tokens=5, seed=7) == [["rollouts"]]
    assert calls == [(engine, [[1, 2]], 3, 5, 7)]


@pytest.mark.slow
def test_vllm_rollouts_from_the_engine_core_are_vllms_front_end_rollouts_bit_for_bit(small, monkeypatch):
    """The engine adds one request per sample to vLLM's engine core and reads its outputs: the tokens and log-probs
    are those of vLLM's own front end with its fan-out of n seeded samples, bit for bit, for several seeds, lengths
    and a repeated prompt, after a weight sync too; a call that fails (a prompt too long for the model, an engine
    step that raises) leaves no request of it in the engine, and the next call is exact again; a request the call
    did not make is left unread."""
    pytest.importorskip("vllm")
    d, model, tok = small
    prompts = _prompts(tok, k=5)
    prompts[3] = prompts[1]  # a repeated prompt draws its own samples
    engine = E.VLLMEngine(d, max_model_len=64, seed=0)
    try:
        assert engine.route == "engine_core"  # the tested vLLM
        def check(seed, max_tokens, n=4):
            groups = engine.generate(prompts, n=n, max_tokens=max_tokens, seed=seed)
            assert [len(g) for g in groups] == [n] * len(prompts)
            assert all(r.prompt_ids == p and r.version == engine.version for g, p in zip(groups, prompts) for r in g)
            got = _flat(groups)
            assert got == _flat(E.front_end_generate(engine, prompts, n, max_tokens, seed))
            assert all(len(lp) == len(t) for t, lp in got)
            return got

        first = check(seed=0, max_tokens=6)
        assert first != check(seed=1, max_tokens=6) and first[1] != first[3 * 4 + 1]
        lengths = {len(t) for t, _ in check(seed=2, max_tokens=20, n=3)}
        assert len(lengths) > 1  # some samples stop at the end-of-sequence token
        _perturb(model, scale=0.05)
        engine.load_weights(model.state_dict(), 1)
        assert check(seed=0, max_tokens=6) != first

        with pytest.raises(Exception, match="n must be at least 1"):  # vLLM checks n before the fan-out
            engine.generate(prompts, n=0, max_tokens=6, seed=3)
        # vLLM's input processor refuses the last prompt after the others were added
        with pytest.raises(Exception, match="maximum context length is 64 tokens"):
            engine.generate(prompts + [list(range(3, 70))], n=4, max_tokens=6, seed=3)
        assert not engine._engine_has_requests()
        core = engine.llm.llm_engine.engine_core
        real, calls = core.get_output, []

        def failing():  # the second engine step runs, then fails
            calls.append(1)
            out = real()
            if len(calls) == 2:
                raise RuntimeError("an engine step failed")
            return out

        monkeypatch.setattr(core, "get_output", failing)
        with pytest.raises(RuntimeError, match="an engine step failed"):
            engine.generate(prompts, n=4, max_tokens=6, seed=3)
        monkeypatch.setattr(core, "get_output", real)
        assert not engine._engine_has_requests()
        check(seed=3, max_tokens=6)

        # a request the call did not make (as an interrupted call could leave) runs beside it, unread
        from vllm import SamplingParams

        stray = engine.llm.llm_engine.input_processor.process_inputs(
            "stray", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=3), supported_tasks=engine._tasks)
        core.add_request(stray)
        groups = engine.generate(prompts, n=4, max_tokens=6, seed=4)
        assert [len(g) for g in groups] == [4] * len(prompts) and not engine._engine_has_requests()
    finally:
        engine.close()


@pytest.mark.slow
def test_a_compiled_vllm_engine_follows_the_trainer_through_in_place_syncs(small):
    """vLLM's compiled forward (compile=True) reads the weights the engine started with, unpacked: every sync is
    the fused in-place copy, and after each AdamW update the engine's log-probs are the trainer's; a reused
    compiled engine gives the same rollouts for the same weights and seed, bit for bit."""
    pytest.importorskip("vllm")
    from vllm.compilation.counter import compilation_counter

    d, model, tok = small
    prompts = _prompts(tok)
    spec = E.EngineSpec("vllm", compile=True)
    aot = compilation_counter.num_aot_compiles
    engine = E.acquire_engine(spec, **_inputs(d, model, tok, seed=0))
    # not vLLM's AOT path, whose artifact this vLLM cannot load back on the CPU (every start would compile anew)
    assert compilation_counter.num_aot_compiles == aot
    start = {k: v.clone() for k, v in model.state_dict().items()}
    engine.load_weights(model.state_dict(), 0)
    assert engine.sync_method == "direct" and engine.weight_sync == "direct"
    ptrs = _assert_synced_in_place(engine, model)
    assert all(m.weight.numel() for m in _vllm_model(engine).modules() if hasattr(m, "cpu_linear"))  # never packed
    expected = engine.generate(prompts, n=4, max_tokens=6, seed=5)
    for version in range(1, 3):
        _adamw_steps(model, prompts, 2)
        with pytest.raises(RuntimeError, match="weight sync failed"):
            E.check_sync(engine, model, prompts, tol=1e-4)  # the compiled forward is stale until the sync
        engine.load_weights(model.state_dict(), version)
        assert E.check_sync(engine, model, prompts, tol=1e-4, seed=version) < 1e-4
        _assert_synced_in_place(engine, model, ptrs)
    model.load_state_dict(start)
    assert E.acquire_engine(spec, **_inputs(d, model, tok, seed=1)) is engine
    engine.load_weights(model.state_dict(), 0)
    assert _flat(engine.generate(prompts, n=4, max_tokens=6, seed=5)) == _flat(expected)
