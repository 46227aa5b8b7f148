"""Compiled programs kept on disk under a key computed before tracing: a warm process neither compiles nor traces.

jax's persistent cache (compile_cache.py) saves XLA's compile, but its key is the lowered program, so every process
still traces and lowers each program to find its entry: in a warm evaluate.py with beam 4 that was 7.6 s for 43
programs against 2.0 s of loading them (docs/compilation.md). `jit` here is jax.jit for the package's own jitted
functions, with an executable store in front: a call's key is computed from what the program is built from, and a hit
loads the serialized executable (jax.experimental.serialize_executable) without tracing. A miss traces, lowers and
compiles as jax.jit would (jax's cache still answers that compile) and writes the executable for the next process.

What the key covers, so that a stored program is never used for a different one:
- the code: a hash of every .py file of this package (any edit misses), and the versions of jax, jaxlib, flax,
  optax, numpy and ml_dtypes;
- the machine: the backend, its platform version, every device (kind, id, process), XLA_FLAGS and
  LIBTPU_INIT_ARGS, jax's trace-time settings (`jax._src.config.trace_context()`: x64, matmul precision, the mesh
  context, ...), the backend the package traces for (`platform.target_backend()`); entries live in compile_cache's
  per-host-CPU directory;
- the function (module and name; a functools.partial's arguments too: the model's graph, for the train step) and the
  jit settings (shardings, donation);
- the call: every static argument's value, the tree structure of the other arguments (with the module and name of
  every node type), and each array's shape, dtype, weak type and sharding.
A value the key cannot describe stably (`stable`: an object from outside the trusted packages, a function defined
in a test, anything with a memory address in its description) makes the call a plain jax.jit call: never a wrong
hit. Entries are checked files (compile_cache.CheckedFileCache): a damaged one is a miss and is replaced.

Off with the cache (`--compilation_cache off`): then `jit` is jax.jit exactly. Ahead-of-time compiles for other
devices (`.trace`, `.lower`) and calls under another trace go to jax.jit too.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import threading
import time
import types
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax._src import config as jax_config
from jax.experimental import serialize_executable

from transformer_jax import compile_cache, platform

FORMAT = 1  # bumped when what an entry holds changes
SUFFIX = "-exe"
USED_PREFIX = "programs-used-"  # `prefetching`'s record of a run's entries (a JSON list of entry names)
PREFETCH_THREADS = 2  # loading releases the GIL: two threads load 44 programs in ~0.9 s against ~1.9 s in one
TRUSTED = ("transformer_jax", "flax", "jax", "jaxlib", "optax", "numpy", "ml_dtypes", "builtins", "collections")
_PACKAGE = Path(__file__).resolve().parent
_DEPTH = 64


class Unkeyable(Exception):
    """A value that `stable` cannot describe the same way in every process."""


def _qualified(obj: Any, local: bool = False) -> str:
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not name or ("<locals>" in name and not local) or module.split(".")[0] not in TRUSTED:
        raise Unkeyable(f"{obj!r} is not a module-level object of {', '.join(TRUSTED)}")
    return f"{module}.{name}"


def _stable_function(f: types.FunctionType, depth: int) -> str:
    """A function of a trusted package: its code is fixed by the package (the source hash or a library version), so
    its name, defaults and the values it closes over (optax's transformations are closures over their settings)
    describe it."""
    cells = []
    for cell in f.__closure__ or ():
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # an empty cell
            cells.append("<empty>")
    return f"{_qualified(f, local=True)}({stable([cells, f.__defaults__, f.__kwdefaults__], depth)})"


def stable(x: Any, depth: int = 0) -> str:
    """A description of x that is equal in every process for equal values and differs where the values could build
    different programs; Unkeyable where it cannot promise both."""
    if depth > _DEPTH:
        raise Unkeyable("nested too deeply")
    d = depth + 1
    if x is None or isinstance(x, (bool, int, float, complex, str, bytes)):
        return f"{type(x).__name__}:{x!r}"
    if isinstance(x, enum.Enum):
        return f"{_qualified(type(x))}.{x.name}"
    if isinstance(x, type):
        return _qualified(x)
    if isinstance(x, np.dtype):
        return f"dtype:{x.str}"
    if isinstance(x, np.ndarray):
        return f"ndarray:{x.dtype.str}{x.shape}:{hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()}"
    if isinstance(x, jax.sharding.Sharding):
        return _stable_sharding(x)
    if isinstance(x, jax.sharding.Mesh):
        return f"Mesh{x.axis_names}{x.devices.shape}{[dev.id for dev in x.devices.flat]}{x.axis_types}"
    if isinstance(x, jax.tree_util.PyTreeDef):
        node = x.node_data()
        head = "leaf" if node is None else f"{_qualified(node[0])}[{stable(node[1], d)}]"
        return f"{head}({','.join(stable(c, d) for c in x.children())})"
    if isinstance(x, functools.partial):
        return f"partial({stable(x.func, d)},{stable(x.args, d)},{stable(x.keywords, d)})"
    if callable(getattr(x, "fingerprint", None)) and not isinstance(x, type):
        return f"{_qualified(type(x))}:{x.fingerprint()}"
    if dataclasses.is_dataclass(x):
        fields = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
        return f"{_qualified(type(x))}{stable(fields, d)}"
    if isinstance(x, (tuple, list)):
        return f"{_qualified(type(x))}[{','.join(stable(v, d) for v in x)}]"
    if isinstance(x, (set, frozenset)):
        return f"{_qualified(type(x))}{{{','.join(sorted(stable(v, d) for v in x))}}}"
    if isinstance(x, Mapping):
        items = sorted((stable(k, d), stable(v, d)) for k, v in x.items())
        return f"{_qualified(type(x))}{{{','.join(f'{k}={v}' for k, v in items)}}}"
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return stable(np.asarray(x), d)
    if isinstance(x, types.FunctionType):
        return _stable_function(x, d)
    if isinstance(x, (types.BuiltinFunctionType, np.ufunc)) or callable(x):
        return _qualified(x)
    if hasattr(x, "__dict__"):
        return f"{_qualified(type(x))}{stable(vars(x), d)}"
    slots = [n for c in type(x).__mro__ for n in getattr(c, "__slots__", ()) if n not in ("__weakref__", "__dict__")]
    if slots:
        return f"{_qualified(type(x))}{stable({n: getattr(x, n, None) for n in slots}, d)}"
    raise Unkeyable(f"{type(x).__name__} has no stable description")


@functools.cache
def _process_key() -> str:
    """What every entry of this process shares: the code, the libraries and the machine (module docstring)."""
    code = hashlib.sha256()
    for file in sorted(_PACKAGE.rglob("*.py")):
        code.update(str(file.relative_to(_PACKAGE)).encode() + b"\0" + file.read_bytes() + b"\0")
    versions = {p: importlib.metadata.version(p) for p in ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes")}
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    backend = jax.devices()[0].client
    flags = {k: os.environ.get(k) for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    return stable([FORMAT, code.hexdigest(), versions, devices, backend.platform, backend.platform_version, flags])


def _arg(x: Any) -> tuple:
    """What a compiled program asks of an argument: (shape, dtype, weak type, sharding); ShapeDtypeStructs (for
    `precompile`) give what the arrays they stand for will."""
    if isinstance(x, jax.Array):
        return x.shape, x.dtype, x.aval.weak_type, x.sharding
    if isinstance(x, jax.ShapeDtypeStruct):
        return x.shape, x.dtype, x.weak_type, x.sharding
    aval = jax.api_util.shaped_abstractify(x)
    return aval.shape, aval.dtype, aval.weak_type, None


def _stable_sharding(sharding: jax.sharding.Sharding) -> str:
    """A sharding with the ids of its devices in order (a Mesh's description names its axes, not its devices).

    An array whole on the default device is described as an argument without a sharding (a host array, which jax
    puts there), however it was placed: training's parameters on its 1-device mesh and evaluate.py's arrays then
    call the same programs (XLA's program for them is the same, and either kind of argument runs it)."""
    if sharding.is_fully_replicated and sharding.device_set == {_default_device()}:
        return "-"
    mesh = getattr(sharding, "mesh", None)
    ids = (
        [d.id for d in mesh.devices.flat]
        if isinstance(mesh, jax.sharding.Mesh)
        else sorted(d.id for d in sharding.device_set)
    )
    return f"{sharding!r}{ids}"


def _default_device() -> jax.Device:
    """The device jax puts a host array on (jax_default_device: a device, a platform's name, or None)."""
    device = jax.config.jax_default_device
    return jax.devices(device)[0] if isinstance(device, str) else device or jax.devices()[0]


def _stable_arg(shape, dtype, weak_type, sharding) -> str:
    return f"{dtype}{list(shape)}{'w' if weak_type else ''}@{'-' if sharding is None else _stable_sharding(sharding)};"


class Jit:
    """jax.jit(fun, **jit_kwargs) with the executable store in front (module docstring); static arguments are
    keyword-only. `fun` may be a functools.partial of a module-level function (its arguments are keyed)."""

    def __init__(self, fun: Callable, *, static_argnames: tuple[str, ...] = (), **jit_kwargs):
        self.jitted = jax.jit(fun, static_argnames=static_argnames, **jit_kwargs)
        self.name = f"jit({getattr(getattr(fun, 'func', fun), '__name__', 'fun')})"
        self.fun = fun
        self.jit_kwargs = jit_kwargs
        self.static_argnames = frozenset(static_argnames)
        self.loaded: dict[tuple, Any] = {}
        functools.update_wrapper(self, fun)

    def trace(self, *args, **kwargs):
        return self.jitted.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.jitted.lower(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        compiled = self.precompile(*args, **kwargs)
        if compiled is None:
            return self.jitted(*args, **kwargs)
        return compiled(*args, **{k: v for k, v in kwargs.items() if k not in self.static_argnames})

    def precompile(self, *args, **kwargs) -> jax.stages.Compiled | None:
        """The program for these arguments (arrays, or ShapeDtypeStructs with shardings), loaded or compiled, kept for
        the calls that follow; None where the store is off or the call runs under another trace."""
        store = compile_cache.store()
        if store is None:
            return None
        static = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        leaves, treedef = jax.tree.flatten((args, {k: v for k, v in kwargs.items() if k not in self.static_argnames}))
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return None
        arg_keys = tuple(_arg(x) for x in leaves)
        context = (jax_config.trace_context(), platform.target_backend())  # both steer tracing
        memory_key = (static, treedef, arg_keys, context)
        compiled = self.loaded.get(memory_key)
        if compiled is None:
            compiled = self.loaded[memory_key] = self._load_or_compile(store, memory_key, args, kwargs)
        return compiled

    def _load_or_compile(self, store, memory_key, args, kwargs) -> jax.stages.Compiled:
        static, treedef, arg_keys, context = memory_key
        try:
            settings = jax.tree.flatten(self.jit_kwargs)  # shardings may sit in pytrees of nnx Variables
            described = stable([_process_key(), context, self.fun, settings[1], settings[0], static, treedef])
            key = hashlib.sha256((described + "".join(_stable_arg(*a) for a in arg_keys)).encode()).hexdigest()
        except Unkeyable as reason:
            logging.debug("%s is compiled without the executable store: %s", self.name, reason)
            return self.jitted.trace(*args, **kwargs).lower().compile()
        entry = _entry(self.name, key)
        prefetched = _Prefetch.take(entry)
        if prefetched is not None:
            return prefetched
        start = time.perf_counter()
        data = store.get(entry)
        if data is not None:
            try:
                compiled = _deserialize(data)
            except Exception as error:  # noqa: BLE001 - an entry that loads wrong is a miss, compiled and replaced
                logging.warning("%s: stored program %s did not load (%s); compiling it", self.name, entry, error)
            else:
                compile_cache.count_program(self.name, time.perf_counter() - start)
                return compiled
        with store.bypassed():  # compiled afresh: see CheckedFileCache.bypassed
            compiled = self.jitted.trace(*args, **kwargs).lower().compile()
        try:
            # XLA:CPU's object code compresses ~5x (jax's own cache compresses its entries too).
            value = zlib.compress(pickle.dumps(serialize_executable.serialize(compiled)), 1)
        except Exception as reason:  # noqa: BLE001 - a program that cannot be saved is only not saved
            logging.debug("%s cannot be stored: %s", self.name, reason)
        else:
            store.put(entry, value)
        return compiled


def _entry(jit_name: str, key: str) -> str:
    """A program's entry name in the store: its function ("_stage" of "jit(_stage)"), its key and SUFFIX."""
    return f"{jit_name[4:-1]}-{key}{SUFFIX}"


def _jit_name(entry: str) -> str:
    """The inverse of `_entry` for the function's name, as the report counts it ("jit(_stage)")."""
    return f"jit({entry[: -len(SUFFIX)].rsplit('-', 1)[0]})"


def _deserialize(data: bytes) -> jax.stages.Compiled:
    return serialize_executable.deserialize_and_load(*pickle.loads(zlib.decompress(data)))


class _Prefetch:
    """One `prefetching` block: the stored programs loading on background threads, by entry name, and the entries
    the block has used, in order (what the next run's block will load)."""

    current: _Prefetch | None = None

    def __init__(self, store: compile_cache.CheckedFileCache, entries: list[str]):
        self.store = store
        self.used: list[str] = []
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="saved-programs")
        self.loading = {entry: self.pool.submit(self._load, entry) for entry in dict.fromkeys(entries)}

    def _load(self, entry: str) -> jax.stages.Compiled | None:
        """The stored program, or None (absent, damaged, not loadable: the call that needs it loads or compiles it
        itself, and says so); counted as a program built when it loads."""
        start = time.perf_counter()
        data = self.store.get(entry)
        if data is None:
            return None
        try:
            compiled = _deserialize(data)
        except Exception:  # noqa: BLE001 - the caller's own load of this entry reports the error
            return None
        compile_cache.count_program(_jit_name(entry), time.perf_counter() - start)
        return compiled

    @classmethod
    def take(cls, entry: str) -> jax.stages.Compiled | None:
        """The program of `entry` if the open block loaded it (waiting for it if it is still loading); records the
        entry as used either way."""
        self = cls.current
        if self is None:
            return None
        with self.lock:
            self.used.append(entry)
            future = self.loading.pop(entry, None)
        return None if future is None else future.result()


def _used_entry(name: str) -> str:
    return USED_PREFIX + hashlib.sha256(f"{_process_key()}\0{name}".encode()).hexdigest()


@contextlib.contextmanager
def prefetching(name: str) -> Iterator[None]:
    """Loads, on background threads, the stored programs that the last block of this `name` (in an earlier process,
    with the same code and machine) used, while the caller goes on (restoring the model, tokenizing): a warm run's
    programs are then in memory when its calls ask for them instead of being loaded one by one as they do. Records
    the programs this block uses for the next one. A program not asked for is dropped at the end; a recorded entry
    that is gone or damaged is loaded or compiled by its call as without this block. `name`: what decides which
    programs a run needs (evaluate.py: its model and decoding options). Nothing happens with the store off or inside
    another block."""
    store = compile_cache.store()
    if store is None or _Prefetch.current is not None:
        yield
        return
    record = _used_entry(name)
    try:
        entries = json.loads(store.get(record, counted=False) or b"[]")
        entries = [e for e in entries if isinstance(e, str) and e.endswith(SUFFIX)]
    except (ValueError, TypeError):  # a record that is not a JSON list: nothing to load
        entries = []
    block = _Prefetch.current = _Prefetch(store, entries)
    try:
        yield
    finally:
        _Prefetch.current = None
        for future in block.loading.values():
            future.cancel()
        block.pool.shutdown(wait=False)
        used = list(dict.fromkeys(block.used))
        if used and used != list(dict.fromkeys(entries)):
            store.put(record, json.dumps(used).encode())


def jit(fun: Callable | None = None, *, static_argnames: tuple[str, ...] = (), **jit_kwargs):
    """`Jit` as a decorator (`@saved_programs.jit(static_argnames=...)`) or a call (`jit(fun, ...)`)."""
    if fun is None:
        return functools.partial(jit, static_argnames=static_argnames, **jit_kwargs)
    return Jit(fun, static_argnames=static_argnames, **jit_kwargs)
