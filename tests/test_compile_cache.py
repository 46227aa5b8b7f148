"""jax's persistent compilation cache as the command lines turn it on: a second process loads what the first
compiled, processes that share the directory get the right results, a changed program or XLA flag misses, a
truncated entry costs a compile and a warning (never a failed run or a wrong result), an unusable directory is one
warning line, and ahead-of-time compiles for a TPU stay quiet."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import flags

from transformer_jax import cli, runtime

PROGRAM = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    from transformer_jax import runtime
    events = []
    jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
    runtime.enable_compile_cache(sys.argv[1])
    y = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))(jnp.arange(64.0).reshape(8, 8) / 64)
    count = lambda name: events.count(f"/jax/compilation_cache/{name}")
    print(json.dumps(dict(y=[float(v) for v in y], hits=count("cache_hits"), writes=count("cache_misses"))))
    """
)
EXPECTED = np.tanh(np.arange(64.0).reshape(8, 8) / 64 @ (np.arange(64.0).reshape(8, 8) / 64).T).sum(axis=0)


def start_program(cache: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", PROGRAM, str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def finish(process: subprocess.Popen) -> tuple[dict, str]:
    """(the program's JSON line, its stderr); the program must succeed with the right values."""
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    np.testing.assert_allclose(result["y"], EXPECTED, rtol=1e-6)
    return result, err


def run_program(cache: Path, **env: str) -> tuple[dict, str]:
    return finish(start_program(cache, **env))


@pytest.fixture
def cache(tmp_path):
    """A cache of the test's own, in this process; the session's cache is back afterwards."""
    yield tmp_path / "xla"
    runtime.enable_compile_cache()


def test_processes_sharing_the_cache_load_what_one_compiled_and_a_changed_xla_flag_misses(cache):
    together = [start_program(cache), start_program(cache)]  # writing and reading the same entries at once
    first = [finish(process)[0] for process in together]
    assert sum(result["writes"] for result in first) >= 1
    later, _ = run_program(cache)
    assert later["hits"] >= 1 and later["writes"] == 0
    flags_changed, _ = run_program(cache, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=1")
    assert flags_changed["writes"] >= 1


def test_a_truncated_entry_is_a_warning_and_a_compile_never_a_wrong_result(cache):
    """What a writer killed mid-write leaves: jax's zlib framing fails to read it, jax warns and compiles."""
    run_program(cache)
    entries = list(runtime.enable_compile_cache(str(cache)).glob("jit__lambda*-cache"))
    assert entries
    for entry in entries:
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    result, err = run_program(cache)
    assert "Error reading persistent compilation cache entry for 'jit__lambda'" in err and "truncated" in err, err


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_a_changed_program_misses_and_the_same_one_hits(cache):
    directory = runtime.enable_compile_cache(str(cache))
    assert directory == cache / runtime.host_kind() and jax.config.jax_compilation_cache_dir == str(directory)

    def compiled(scale: float):
        return jax.jit(lambda x: jnp.sin(x * scale).sum())(jnp.arange(16.0))

    compiled(1.0)
    written = {p.name for p in directory.glob("jit__lambda*")}
    compiled(2.0)
    assert {p.name for p in directory.glob("jit__lambda*")} > written  # a program of its own
    x = jnp.arange(16.0)
    jax.clear_caches()  # forget the in-memory executables: the next compile asks the disk
    hits = []

    def listener(event: str, **kwargs) -> None:
        hits.append(event)

    jax.monitoring.register_event_listener(listener)
    try:
        result = float(jax.jit(lambda x: jnp.sin(x * 2.0).sum())(x))
    finally:
        jax.monitoring.unregister_event_listener(listener)
    assert result == pytest.approx(float(np.sin(np.arange(16.0) * 2).sum()), rel=1e-6)
    assert hits.count("/jax/compilation_cache/cache_hits") == 1, hits  # loaded from the disk, not compiled


def test_an_unusable_directory_is_one_warning_and_no_cache(tmp_path, cache, capsys):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    assert runtime.enable_compile_cache(str(blocked / "xla")) is None and runtime.compile_cache_directory() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: compilation cache") and str(blocked) in err[0]
    assert float(jax.jit(lambda x: x.sum() * 4)(jnp.arange(4.0))) == 24.0


def test_every_command_line_takes_compilation_cache(tmp_path, cache):
    flag_values = flags.FlagValues()
    cli.parse_flags("prog", ["prog", f"--compilation_cache={tmp_path / 'mine'}"], flag_values)
    assert runtime.compile_cache_directory() == tmp_path / "mine" / runtime.host_kind()
    cli.parse_flags("prog", ["prog", "--compilation_cache=off"], flags.FlagValues())
    assert runtime.compile_cache_directory() is None and jax.config.jax_compilation_cache_dir is None


def test_the_default_directory_and_the_environment(monkeypatch):
    assert runtime.resolve_compile_cache("off") is None
    assert runtime.resolve_compile_cache("~/x") == Path.home() / "x"
    # conftest's session directory
    assert runtime.resolve_compile_cache(None) == Path(os.environ[runtime.COMPILE_CACHE_ENV])
    monkeypatch.delenv(runtime.COMPILE_CACHE_ENV)
    assert runtime.resolve_compile_cache(None) == Path.home() / ".cache" / "transformer_jax" / "xla"


AOT_PROGRAM = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from absl import flags
    from transformer_jax import cli
    from transformer_jax.plan import accelerators
    cli.parse_flags("prog", ["prog", f"--compilation_cache={sys.argv[1]}"], flags.FlagValues())
    mesh = jax.sharding.Mesh(np.array(accelerators.tpu_devices("v5e:2x2")), ("d",))
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, jax.P("d")))
    for _ in range(2):  # the second compile finds the first one's entry, which a compile-only client cannot load
        print(jax.jit(lambda a: (a @ a.T).sum()).trace(x).lower().compile().cost_analysis()["flops"])
        jax.clear_caches()
    """
)


def test_ahead_of_time_compiles_for_a_tpu_work_and_the_command_lines_stay_quiet(cache):
    pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu (pip install -r requirements-aot.txt)")
    done = subprocess.run(
        [sys.executable, "-c", AOT_PROGRAM, str(cache)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    flops = [float(line) for line in done.stdout.split()]
    assert len(flops) == 2 and flops[0] == flops[1] > 0
    assert "persistent compilation cache" not in done.stderr, done.stderr
