"""GPU attention, compiled on this host for one GPU (H100, H200) without a GPU: compiler estimates, not timings.

    python -m benchmarks.attention --gpu_target h100

One JSON line per (implementation, length, head dim) for causal forward + backward (jax.vjp) in bfloat16, B = 1,
N = 1024 / H heads, T = S: compile time (this host), and memory_analysis() temp, argument and output bytes: what
the CUDA plugin's compiler says the program would allocate on that GPU. cost_analysis() gives nothing for a
program compiled this way (the plugin returns no cost model without a device), so the records have no flops.
`custom_calls` names the kernels the compiled program calls (Triton, cuDNN, cuBLAS), which shows what would run.

Implementations: ours (attention impl=pallas, Triton), jax's pallas.ops.gpu.attention.mha (Triton, its default
tiles), cudnn (attention impl=cudnn: jax.nn.dot_product_attention's cuDNN flash attention) and xla.
The target configs are transformer_jax/plan/gpu_targets/*.txtpb (accelerators.parse_topology).

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.attention_tpu import MODEL_WIDTH
from transformer_jax import ops, runtime
from transformer_jax.errors import ConfigError
from transformer_jax.plan import accelerators

Array = jax.Array
IMPLS = ("ours", "jax_pallas", "cudnn", "xla")
CHIPS = tuple(chip.name for chip in accelerators.CHIPS.values() if chip.platform == "cuda")
_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')


def gpu_device(chip: str) -> jax.Device:
    """The one device of `chip`:1 (h100, h200); another name is one line listing the GPUs we have targets for."""
    if chip not in CHIPS:
        raise ConfigError(f"--gpu_target {chip!r}: expected one of {', '.join(CHIPS)}")
    return accelerators.parse_topology(f"{chip}:1").devices()[0]


def attention_fn(impl: str) -> Callable[[Array, Array, Array], Array]:
    """q, k, v [B, T, N, H] -> causal attention out [B, T, N, H]."""
    if impl == "jax_pallas":
        from jax.experimental.pallas.ops.gpu import attention as jax_attention  # Triton: imported for GPU rows only

        return lambda q, k, v: jax_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True)
    return lambda q, k, v: ops.attention(q, k, v, impl="pallas" if impl == "ours" else impl, causal=True)


def measure(chip: str, impl: str, length: int, head_dim: int) -> dict:
    heads = MODEL_WIDTH // head_dim
    record = dict(
        gpu=chip, impl=impl, seq_len=length, head_dim=head_dim, mask="causal", dtype="bfloat16", batch=1,
        heads=heads, figures="compiler estimates (memory_analysis), not timings",
    )  # fmt: skip
    sharding = jax.sharding.SingleDeviceSharding(gpu_device(chip))
    spec = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.bfloat16, sharding=sharding)
    fn = attention_fn(impl)

    def fwd_bwd(q: Array, k: Array, v: Array, do: Array) -> tuple:
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)

    start = time.perf_counter()
    try:
        with runtime.compiling_for("gpu"):
            compiled = jax.jit(fwd_bwd).trace(spec, spec, spec, spec).lower().compile()
    except Exception as e:  # an unsupported combination is a result too
        record["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return record
    record["compile_s"] = round(time.perf_counter() - start, 2)
    memory = compiled.memory_analysis()
    record["temp_bytes"] = int(memory.temp_size_in_bytes)
    record["argument_bytes"] = int(memory.argument_size_in_bytes)
    record["output_bytes"] = int(memory.output_size_in_bytes)
    record["custom_calls"] = sorted(set(_CUSTOM_CALL.findall(compiled.as_text())))
    return record


def report(chip: str, seq_lens: list[int], head_dims: list[int], impls: list[str]) -> None:
    gpu_device(chip)  # a wrong name fails before any compile
    unknown = sorted(set(impls) - set(IMPLS))
    if unknown:
        raise ConfigError(f"--impls {','.join(unknown)}: unknown for --gpu_target; expected some of {','.join(IMPLS)}")
    for length in seq_lens:
        for head_dim in head_dims:
            for impl in impls:
                print(json.dumps(measure(chip, impl, length, head_dim)), flush=True)
