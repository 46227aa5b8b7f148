"""Test-wide settings: compile fast, run on the CPU, and keep compiled programs for the session.

The tests' programs are tiny, so XLA's compile time, not run time, dominates the suite; the lowest optimisation
level and the flags below compile several times faster. Set before JAX starts its backend; subprocesses (train.py
in the resume tests) inherit it, so compared runs share it.

The tests run on the CPU (JAX_PLATFORMS=cpu unless set): on a CPU host with libtpu installed (requirements-aot.txt,
for the TPU compile tests) jax would otherwise try the TPU first and print its initialisation errors; several test
processes may load libtpu at once (ALLOW_MULTIPLE_LIBTPU_LOAD: its lock guards a TPU this host does not have).
oneDNN's matmuls are capped at AVX2 (ONEDNN_MAX_CPU_ISA unless set), so results are the same bits on any x86 CPU.

jax's persistent compilation cache (transformer_jax/runtime.py) lives in a directory of the test session's
own, shared by the xdist workers and the subprocesses they start (through the environment), and removed at the
end: tests never read a user's cache, and a program compiled by one test process is loaded by the others.
"""

import gc
import importlib.util
import json
import os
import shutil
import tempfile

# XLA:CPU's fusion emitters cost more per program than its elemental emitter, and codegen split into parallel
# parts oversubscribes the cores the xdist workers already share (docs/compilation.md, "The tests").
_FAST = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST}".strip()
# The TPU and GPU compilers (the plans and AOT tests compile for chips this host does not have) search less for a
# fast program at the lowest execution-time effort. The tests check the plans' rules, not their numbers; users'
# plans keep the default.
os.environ.setdefault("JAX_EXEC_TIME_OPTIMIZATION_EFFORT", "-1.0")
# Tracing allocates many short-lived objects, and at Python's default threshold the collector runs thousands of
# times over a test file (docs/compilation.md, "The tests"). Reference counting still frees every array at once;
# only cycles wait longer.
gc.set_threshold(50_000, 20, 20)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# XLA:CPU's matmuls call oneDNN's sgemm, which picks its kernels by the CPU's instruction set: an AVX-512 machine and
# an AVX2 one sum in different orders and differ in the last bits. Capped at AVX2, every x86 machine the suite runs on
# computes the same bits, so stored values (tests/test_lora.py) hold on all of them.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")


# Imported after XLA_FLAGS is set: importing the helpers imports JAX.
import pathlib  # noqa: E402

import pytest  # noqa: E402

from tests.helpers.training import write_corpus  # noqa: E402
from transformer_jax import runtime  # noqa: E402


def shared_path(tmp_path_factory, worker_id: str, name: str, build) -> pathlib.Path:
    """`name` in a folder all the run's processes share, built by `build(path)` once per run: under xdist the
    workers' base temps sit in one folder, and a lock makes the first worker build while the other waits. A marker
    written after the build says it finished; a failed build is redone by the next user. Its users treat it as
    read-only (copying it first where they change it)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        root = root.parent
    path, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path


def _hf_folders(family: str):
    """A builder of m2m100_reference.FOLDERS[family]'s random-weight Hugging Face folder (PATH/hf) and, where
    ctranslate2 is installed, CTranslate2's own conversion of it (PATH/ct2, m2m100_reference.ct2_oracle) in one
    process: the two share its ~10 s of torch and transformers imports."""

    def build(path: pathlib.Path) -> None:
        from tests.helpers.m2m100_reference import FOLDERS, ct2_oracle, run

        hf, spec = path / "hf", json.dumps(FOLDERS[family])
        if importlib.util.find_spec("ctranslate2") is None:
            run("make", str(hf), spec)
        else:
            run("make_ct2", str(hf), spec, str(ct2_oracle(hf)))

    return build


@pytest.fixture(scope="session")
def nllb_dir(tmp_path_factory, worker_id) -> pathlib.Path:
    """A random-weight NLLB-200-style Hugging Face folder with its tokenizer, built once per test run: the import,
    export and CTranslate2 tests read it and never write into it."""
    return shared_path(tmp_path_factory, worker_id, "nllb", _hf_folders("nllb")) / "hf"


@pytest.fixture(scope="session")
def m2m_dir(tmp_path_factory, worker_id) -> pathlib.Path:
    """As nllb_dir, an M2M-100-style folder (vocab.json, 100 __xx__ codes, 8 madeup words)."""
    return shared_path(tmp_path_factory, worker_id, "m2m100", _hf_folders("m2m100")) / "hf"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pathlib.Path:
    """The training helpers' word-for-word corpus (write_corpus), written once per test module."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def tiny_corpus_env(corpus, monkeypatch) -> pathlib.Path:
    """`corpus`, named by $TINY_CORPUS: where tests/tiny_sweep_config.py reads its data."""
    monkeypatch.setenv("TINY_CORPUS", str(corpus))
    return corpus


_OWN_CACHE = None


def pytest_configure(config):
    global _OWN_CACHE
    # the controller (or a run without xdist) makes it; workers inherit it
    if runtime.COMPILE_CACHE_ENV not in os.environ:
        _OWN_CACHE = tempfile.mkdtemp(prefix="transformer_jax_test_xla_")
        os.environ[runtime.COMPILE_CACHE_ENV] = _OWN_CACHE
    runtime.enable_compile_cache()


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
