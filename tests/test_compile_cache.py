"""The persistent compilation cache: a second process loads what the first compiled, a changed program or XLA flag
misses, and a damaged entry, an unusable directory or a full disk cost a compile and one warning line, never a
failed run or a wrong result."""

import errno
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

from transformer_jax import cli, compile_cache

PROGRAM = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    from transformer_jax import compile_cache
    store = compile_cache.enable(sys.argv[1], min_compile_seconds=0)
    y = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))(jnp.arange(64.0).reshape(8, 8) / 64)
    print(json.dumps(dict(y=[float(v) for v in y], hits=store.stats.hits, writes=store.stats.writes)))
    """
)


def run_program(cache: Path, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(cache)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def cache(tmp_path):
    """A cache of the test's own, in this process; the session's cache is back afterwards."""
    yield tmp_path / "xla"
    compile_cache.enable()


def compiled(scale: float):
    return jax.jit(lambda x: jnp.sin(x * scale).sum())(jnp.arange(16.0))


def test_a_second_process_loads_what_the_first_compiled_and_a_changed_xla_flag_misses(cache):
    first = run_program(cache)
    second = run_program(cache)
    assert first["writes"] >= 1 and first["hits"] == 0
    assert second["hits"] >= 1 and second["writes"] == 0
    assert second["y"] == first["y"]
    flags_changed = run_program(cache, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_math=true")
    assert flags_changed["hits"] == 0 and flags_changed["writes"] >= 1


def test_a_changed_program_misses_and_the_same_one_hits(cache):
    store = compile_cache.enable(str(cache), min_compile_seconds=0)
    compiled(1.0), compiled(2.0)
    assert store.stats.hits == 0 and store.stats.writes >= 2
    jax.clear_caches()  # forget the in-memory executables: the next compile asks the disk
    entries = {p.name for p in store.path.iterdir()}
    assert float(compiled(2.0)) == pytest.approx(float(np.sin(np.arange(16.0) * 2).sum()), rel=1e-6)
    # The program itself comes from the disk; helpers first compiled before this cache existed may be written.
    assert store.stats.hits >= 1
    assert not [name for name in {p.name for p in store.path.iterdir()} - entries if name.startswith("jit__lambda")]


def test_the_report_counts_programs_compiled_and_loaded(cache):
    """compile_cache.compilations(), which evaluate.py's report and train.py's first-step line print."""
    compile_cache.enable(str(cache), min_compile_seconds=0)
    before = compile_cache.compilations()
    compiled(4.0)
    after = compile_cache.compilations()
    assert after["programs"] - before["programs"] >= 1 and after["compiled"] - before["compiled"] >= 1
    assert after["loaded_from_cache"] == before["loaded_from_cache"] and after["seconds"] > before["seconds"]
    jax.clear_caches()
    compiled(4.0)
    again = compile_cache.compilations()
    assert again["loaded_from_cache"] - after["loaded_from_cache"] >= 1 and again["programs"] > after["programs"]
    assert again["functions"]["jit(<lambda>)"] >= 2 and again["cache"] == str(compile_cache.store().path)


def test_a_damaged_entry_is_one_warning_a_compile_and_is_replaced(cache, capsys):
    store = compile_cache.enable(str(cache), min_compile_seconds=0)
    expected = float(compiled(3.0))
    entries = [p for p in store.path.iterdir() if not p.name.startswith(".")]
    for entry in entries:
        data = bytearray(entry.read_bytes())
        data[len(data) // 2] ^= 0xFF
        entry.write_bytes(bytes(data))
    jax.clear_caches()
    capsys.readouterr()
    assert float(compiled(3.0)) == expected
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "damaged" in warnings[0]
    assert store.stats.damaged >= 1
    jax.clear_caches()
    hits = store.stats.hits
    assert float(compiled(3.0)) == expected and store.stats.hits > hits  # the replaced entry is good


def test_an_unusable_directory_is_one_warning_and_no_cache(tmp_path, cache, capsys):
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    assert compile_cache.enable(str(blocked / "xla")) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: compilation cache") and str(blocked) in err[0]
    assert float(compiled(4.0)) == pytest.approx(float(np.sin(np.arange(16.0) * 4).sum()), rel=1e-6)


def test_a_full_disk_is_one_warning_and_compiling_goes_on(cache, capsys, monkeypatch):
    store = compile_cache.enable(str(cache), min_compile_seconds=0)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(compile_cache.os, "replace", full)
    capsys.readouterr()
    assert float(compiled(5.0)) == pytest.approx(float(np.sin(np.arange(16.0) * 5).sum()), rel=1e-6)
    compiled(6.0)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "No space left on device" in warnings[0]
    assert store.stats.writes == 0 and not list(store.path.glob(".tmp-*"))  # no partial file left behind


def test_every_command_line_takes_compilation_cache(tmp_path, cache):
    flag_values = flags.FlagValues()
    cli.parse_flags("prog", ["prog", f"--compilation_cache={tmp_path / 'mine'}"], flag_values)
    assert compile_cache.store().path.parent == tmp_path / "mine"
    cli.parse_flags("prog", ["prog", "--compilation_cache=off"], flags.FlagValues())
    assert compile_cache.store() is None and jax.config.jax_compilation_cache_dir is None


def test_the_default_directory_and_the_environment():
    assert compile_cache.resolve("off") is None
    assert compile_cache.resolve("~/x") == Path.home() / "x"
    assert compile_cache.resolve(None) == Path(os.environ[compile_cache.ENV])  # conftest's session directory


def test_ahead_of_time_compiles_for_a_tpu_leave_the_cache_alone(cache, capfd):
    accelerators = pytest.importorskip("transformer_jax.plan.accelerators")
    try:
        devices = accelerators.tpu_devices("v5e:2x2")
    except Exception as error:  # noqa: BLE001 - any failure to make the devices means libtpu is not usable here
        pytest.skip(f"compiling for TPU needs libtpu (pip install -r requirements-aot.txt): {error}")
    store = compile_cache.enable(str(cache), min_compile_seconds=0)
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, jax.P("d")))
    capfd.readouterr()
    for _ in range(2):
        compiled = jax.jit(lambda a: (a @ a.T).sum()).trace(x).lower().compile()
        assert compiled.cost_analysis()["flops"] > 0
        jax.clear_caches()
    assert store.stats.writes == store.stats.hits == 0
    assert "persistent compilation cache" not in capfd.readouterr().err
