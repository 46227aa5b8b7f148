"""Programs saved under a key computed before tracing (transformer_jax/saved_programs.py): a fresh wrapper (as in a
new process) loads them without tracing or compiling; a changed static argument, XLA flag or source file misses; a
value the key cannot describe, a damaged entry or an entry that does not load costs a compile, never a wrong
result."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers.decoding import shared_model, sources_BS
from tests.helpers.training import one_layer_config, synthetic_batch
from transformer_jax import compile_cache, saved_programs
from transformer_jax.decoding import transformer as binding
from transformer_jax.decoding.search import BeamState, length_penalty
from transformer_jax.evaluation.restore import abstract_model
from transformer_jax.model import Transformer, TransformerSpec
from transformer_jax.sharding import make_mesh, state_shardings
from transformer_jax.training.state import create_train_state, eval_model
from transformer_jax.training.step import compile_steps


class NoTracing:
    """Stands in for a wrapper's jax.jit: any trace, lower or call fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the program was traced or compiled ({name}) although it was saved")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the program was traced or compiled although it was saved")


@contextlib.contextmanager
def decoding_calls_without_tracing():
    """The decoding binding's saved-program wrappers with nothing loaded in memory (as in a new process) and any
    trace or compile failing the test, for the duration of the block."""
    wrappers = [f for f in vars(binding).values() if isinstance(f, saved_programs.Jit)]
    jitted = [f.jitted for f in wrappers]
    for f in wrappers:
        f.loaded.clear()
        f.jitted = NoTracing()
    try:
        yield
    finally:
        for f, j in zip(wrappers, jitted, strict=True):
            f.jitted = j


@pytest.fixture
def store(tmp_path):
    """A cache of the test's own, in this process; the session's cache is back afterwards."""
    yield compile_cache.enable(str(tmp_path / "xla"))
    compile_cache.enable()
    saved_programs._process_key.cache_clear()


def fresh(**static) -> saved_programs.Jit:
    """A new wrapper of the same module-level function: nothing in memory, as in a new process."""
    return saved_programs.Jit(length_penalty, static_argnames=("penalty",), **static)


def entries(store) -> list:
    return sorted(p.name for p in store.path.glob(f"*{saved_programs.SUFFIX}*"))


LENGTHS, ALPHA = jnp.arange(1, 9), jnp.float32(0.6)


def expected(penalty: str = "gnmt") -> np.ndarray:
    return np.asarray(length_penalty(LENGTHS, ALPHA, penalty))


def test_a_fresh_wrapper_loads_the_saved_program_without_tracing(store):
    np.testing.assert_allclose(fresh()(LENGTHS, ALPHA, penalty="gnmt"), expected(), rtol=1e-6)
    assert len(entries(store)) == 1
    again = fresh()
    again.jitted = NoTracing()
    hits = store.stats.hits
    np.testing.assert_allclose(again(LENGTHS, ALPHA, penalty="gnmt"), expected(), rtol=1e-6)
    assert store.stats.hits == hits + 1
    assert compile_cache.compilations()["functions"]["jit(length_penalty)"] >= 2  # counted in the report


def test_a_changed_static_argument_shape_xla_flag_or_target_backend_misses(store, monkeypatch):
    fresh()(LENGTHS, ALPHA, penalty="gnmt")
    np.testing.assert_allclose(fresh()(LENGTHS, ALPHA, penalty="average"), expected("average"), rtol=1e-6)
    fresh()(LENGTHS[:4], ALPHA, penalty="gnmt")
    fresh()(LENGTHS.astype(jnp.float32), ALPHA, penalty="gnmt")
    assert len(entries(store)) == 4
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    saved_programs._process_key.cache_clear()
    fresh()(LENGTHS, ALPHA, penalty="gnmt")
    assert len(entries(store)) == 5
    # The backend the package traces for (platform.compiling_for) chooses kernels: it is part of the key.
    monkeypatch.setattr(saved_programs.platform, "target_backend", lambda: "gpu")
    fresh()(LENGTHS, ALPHA, penalty="gnmt")
    assert len(entries(store)) == 6


def test_the_key_covers_every_source_file(tmp_path, monkeypatch):
    package = tmp_path / "package"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "a.py").write_text("X = 1\n")
    monkeypatch.setattr(saved_programs, "_PACKAGE", package)
    saved_programs._process_key.cache_clear()
    before = saved_programs._process_key()
    (package / "sub" / "a.py").write_text("X = 2\n")
    saved_programs._process_key.cache_clear()
    assert saved_programs._process_key() != before
    saved_programs._process_key.cache_clear()


@dataclasses.dataclass(frozen=True)
class Setting:
    width: int


def test_stable_descriptions_differ_with_values_and_refuse_what_they_cannot_describe():
    s = saved_programs.stable
    assert s(BeamState) == s(BeamState) and s(1) != s(1.0) != s(True) and s("a") != s(b"a")
    assert s({"a": 1, "b": (2, None)}) == s({"b": (2, None), "a": 1}) != s({"a": 1, "b": (3, None)})
    assert s(jax.tree.structure({"a": 1})) != s(jax.tree.structure({"b": 1}))
    assert s(jnp.float32) != s(jnp.bfloat16) and s(np.dtype("int32")) != s(np.dtype("int64"))
    for unkeyable in (lambda x: x, Setting(3), object()):  # a test's own function, class, and an address
        with pytest.raises(saved_programs.Unkeyable):
            s(unkeyable)


def test_the_models_graph_is_described_by_every_static_attribute():
    def graph(**changes) -> binding.Graph:
        spec = dataclasses.replace(shared_model().spec, **changes)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(spec, rngs=nnx.Rngs(0))))
        return binding.graph(graphdef, jax.tree.structure(state))

    assert isinstance(shared_model().spec, TransformerSpec)
    same = graph().fingerprint()
    assert same == graph().fingerprint()
    # Settings that keep every parameter's shape: only the graph's static attributes tell the programs apart.
    for change in ({"activation": "gelu"}, {"norm_position": "pre"}, {"attention_window": 3}):
        assert graph(**change).fingerprint() != same, change


def test_an_undescribable_call_is_a_plain_jit_call(store):
    wrapped = saved_programs.Jit(lambda x: x * 2)
    assert float(wrapped(jnp.float32(3.0))) == 6.0
    assert entries(store) == []


def test_a_damaged_entry_or_one_that_does_not_load_is_compiled_and_replaced(store, capsys):
    fresh()(LENGTHS, ALPHA, penalty="gnmt")
    (entry,) = [store.path / name for name in entries(store)]
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    capsys.readouterr()
    np.testing.assert_allclose(fresh()(LENGTHS, ALPHA, penalty="gnmt"), expected(), rtol=1e-6)
    assert "damaged" in capsys.readouterr().err and store.stats.damaged == 1
    store.put(entry.name[: -len("-xla")], b"not a program")  # a checksum that holds over bytes that do not load
    np.testing.assert_allclose(fresh()(LENGTHS, ALPHA, penalty="gnmt"), expected(), rtol=1e-6)
    again = fresh()
    again.jitted = NoTracing()
    np.testing.assert_allclose(again(LENGTHS, ALPHA, penalty="gnmt"), expected(), rtol=1e-6)  # replaced: good


def test_a_program_jax_loaded_from_its_cache_is_not_what_is_saved(store, monkeypatch):
    """An executable jax deserialized from its own cache entry serializes into one that fails at its first call
    ("Function ... not found"): what is saved is compiled afresh. Also: a whole refilling search runs from saved
    programs, as in a warm process."""
    model = shared_model()
    src_BS, max_len_B = np.asarray(sources_BS(16, 7)), np.full((16,), 6, np.int32)
    with monkeypatch.context() as m:  # plain jax.jit calls: jax's own cache gets these programs, nothing is saved
        m.setattr(saved_programs.compile_cache, "store", lambda: None)
        want = binding.searcher(model)(src_BS, max_len_B, beam_size=2, alpha=0.6, max_steps=6)
    assert entries(store) == []
    jax.clear_caches()
    wrappers = {n: f for n, f in vars(binding).items() if isinstance(f, saved_programs.Jit)}
    for f in wrappers.values():  # programs an earlier test of this process loaded stay in memory otherwise
        f.loaded.clear()
    binding.searcher(model)(src_BS, max_len_B, beam_size=2, alpha=0.6, max_steps=6)  # jax's cache has them all
    assert {name.split("-")[0] for name in entries(store)} >= {"_start", "_stage", "_outcome"}
    with decoding_calls_without_tracing():
        got = binding.searcher(model)(src_BS, max_len_B, beam_size=2, alpha=0.6, max_steps=6)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6)


def test_evaluate_pys_model_decodes_with_the_programs_validation_bleu_saved_in_training(store):
    """Validation BLEU decodes with the train state's eval model, its arrays on the run's 1-device mesh; evaluate.py
    with a model built abstractly (restore.abstract_model) and filled with host arrays from the checkpoint. Both
    call the same saved programs, so the first evaluate.py after a run with validation BLEU loads them. Failed
    with evaluate.py's model built from other random streams (another graph) or the mesh's sharding in the key."""
    config = one_layer_config()
    graphs, state = create_train_state(config)
    state = jax.device_put(state, state_shardings(state, make_mesh(), "data"))
    validation_model = eval_model(graphs, state)
    src_BS, max_len_B = np.asarray(sources_BS(16, 7)), np.full((16,), 6, np.int32)
    want = binding.searcher(validation_model)(src_BS, max_len_B, beam_size=2, alpha=0.6, max_steps=6)
    evaluation_model = abstract_model(config)
    nnx.update(evaluation_model, jax.device_get(nnx.state(validation_model, nnx.Param)))
    evaluation_model.eval()
    with decoding_calls_without_tracing():
        got = binding.searcher(evaluation_model)(src_BS, max_len_B, beam_size=2, alpha=0.6, max_steps=6)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6)


def test_a_restarted_train_step_loads_without_tracing_and_a_changed_optimizer_setting_misses(store):
    """train.py's step: a partial over the train graph, whose optimizer is optax closures over its settings."""

    def step_for(config):
        graphs, state = create_train_state(config)
        step, _, _ = compile_steps(graphs, state, make_mesh(), "data", label_smoothing=0.1, accum_steps=1)
        return step, state

    config, batch = one_layer_config(), synthetic_batch(0, rows=8)
    step, state = step_for(config)
    _, want = step(state, batch)
    restarted, state = step_for(config)  # a new process's step: nothing in memory
    restarted.jitted = NoTracing()
    hits = store.stats.hits
    _, got = restarted(state, batch)
    assert store.stats.hits == hits + 1
    np.testing.assert_allclose(got["loss_sum"], want["loss_sum"], rtol=1e-6)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-6)
    config.opt.b2 = 0.99  # same shapes, same model: only the optimizer's closures differ
    other, _ = step_for(config)
    assert saved_programs.stable(other.fun) != saved_programs.stable(step.fun)
    assert saved_programs.stable(step_for(one_layer_config())[0].fun) == saved_programs.stable(step.fun)


def test_a_prefetching_block_loads_what_the_last_block_of_its_name_used_on_background_threads(store, monkeypatch):
    with saved_programs.prefetching("run"):
        fresh()(LENGTHS, ALPHA, penalty="gnmt")
        fresh()(LENGTHS, ALPHA, penalty="average")
    assert len(list(store.path.glob(f"{saved_programs.USED_PREFIX}*"))) == 1
    loads = []
    deserialize = saved_programs._deserialize
    monkeypatch.setattr(
        saved_programs, "_deserialize", lambda data: loads.append(threading.current_thread().name) or deserialize(data)
    )
    with saved_programs.prefetching("run"):  # a new process's block: fresh wrappers, nothing in memory
        concurrent.futures.wait(saved_programs._Prefetch.current.loading.values())
        assert len(loads) == 2 and all(name.startswith("saved-programs") for name in loads)
        hits = store.stats.hits
        for penalty in ("gnmt", "average"):
            again = fresh()
            again.jitted = NoTracing()
            np.testing.assert_allclose(again(LENGTHS, ALPHA, penalty=penalty), expected(penalty), rtol=1e-6)
        assert store.stats.hits == hits and len(loads) == 2  # the calls took the loaded programs, read nothing
    with saved_programs.prefetching("another run"):  # another name: nothing loads ahead
        assert saved_programs._Prefetch.current.loading == {}


def test_a_prefetch_record_naming_lost_or_damaged_programs_or_not_a_list_costs_nothing_but_their_compile(store):
    with saved_programs.prefetching("run"):
        fresh()(LENGTHS, ALPHA, penalty="gnmt")
        fresh()(LENGTHS, ALPHA, penalty="average")
    first, second = [store.path / name for name in entries(store)]
    first.unlink()
    second.write_bytes(b"damaged")
    with saved_programs.prefetching("run"):
        for penalty in ("gnmt", "average"):
            np.testing.assert_allclose(fresh()(LENGTHS, ALPHA, penalty=penalty), expected(penalty), rtol=1e-6)
    (record,) = store.path.glob(f"{saved_programs.USED_PREFIX}*")
    store.put(record.name[: -len("-xla")], b"{not json")
    with saved_programs.prefetching("run"):
        assert saved_programs._Prefetch.current.loading == {}
        np.testing.assert_allclose(fresh()(LENGTHS, ALPHA, penalty="gnmt"), expected(), rtol=1e-6)


def test_a_set_aside_search_runs_from_its_own_saved_programs(store):
    """The set-aside beam search (decoding/set_aside.py) saves programs of its own (the pool's size is a static
    argument of `_start`, its state's type part of every later call's key): the in-beam search's are never taken
    for it, and a second run, as in a warm process, loads all of them without tracing, with equal results."""
    model = shared_model()
    src_BS, max_len_B = np.asarray(sources_BS(16, 7)), np.full((16,), 6, np.int32)
    wrappers = {n: f for n, f in vars(binding).items() if isinstance(f, saved_programs.Jit)}
    for f in wrappers.values():
        f.loaded.clear()
    search = dict(beam_size=3, alpha=1.0, max_steps=6, penalty="average", settle=2)
    binding.searcher(model)(src_BS, max_len_B, finished="in_beam", **search)
    in_beam = {name for name in entries(store) if name.startswith(("_start", "_stage"))}
    want = binding.searcher(model)(src_BS, max_len_B, finished="set_aside", **search)
    both = {name for name in entries(store) if name.startswith(("_start", "_stage"))}
    assert {n.split("-")[0] for n in both - in_beam} == {"_start", "_stage"}
    with decoding_calls_without_tracing():
        got = binding.searcher(model)(src_BS, max_len_B, finished="set_aside", **search)
    assert got.tokens.shape[1] == 2  # the pool's two best
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-6)
