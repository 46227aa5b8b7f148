"""Attention implementations: time, TFLOP/s and compiled peak memory; one JSON line per configuration.

FLOPs count the model's matmuls, whatever an implementation recomputes:
    forward = 4 * B * N * T * S * H  (Q K^T and P V, 2 FLOPs per multiply-add), halved when causal;
    forward + backward = 2.5 * forward (the factor this project's issue 6 specifies; FlashAttention's papers count
    the backward alone as 2.5 * forward, i.e. fwd+bwd = 3.5 * forward: multiply our fwd+bwd TFLOP/s by 1.4).
Peak memory = temp + argument + output - alias bytes of the compiled program (Compiled.memory_analysis()), known
before running, so configurations that would not fit are reported, not run.

CPU (the default):
    python -m benchmarks.attention --impls xla,blockwise --seq_lens 1024,2048,4096,8192,16384,32768
ends with a summary line: blockwise memory growth 32k/4k and time relative to the reference.
GPU, the whole check in one call (about 8 minutes on an H100/H200):
    python -m benchmarks.attention --device_report
TPU compiler estimates on this host, without a TPU (benchmarks/attention_tpu.py; needs requirements-aot.txt):
    python -m benchmarks.attention --tpu_topology v5e:2x2
GPU compiler estimates on this host, without a GPU (benchmarks/attention_gpu.py; needs requirements-aot.txt):
    python -m benchmarks.attention --gpu_target h100

Axis legend: B batch, T query length, S key/value length, N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from benchmarks import attention_gpu, attention_tpu
from transformer_jax import cli, ops
from transformer_jax.errors import ConfigError

Array = jax.Array
FWD_BWD_FACTOR = 2.5
GIB = 1 << 30


def flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs, 4 B N T S H, halved for causal."""
    f = 4.0 * batch * heads * q_len * kv_len * head_dim
    return f / 2 if causal else f


def attention_fn(impl: str, causal: bool, **impl_kwargs) -> Callable[[Array, Array, Array], Array]:
    """q, k, v -> out for one implementation; 'jax_pallas' is JAX's bundled Triton kernel (GPU only)."""
    if impl == "jax_pallas":
        from jax.experimental.pallas.ops.gpu import attention as jax_attention

        def run(q: Array, k: Array, v: Array) -> Array:
            return jax_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=causal)

        return run
    return lambda q, k, v: ops.attention(q, k, v, causal=causal, impl=impl, **impl_kwargs)


def fwd_bwd_fn(fn: Callable[[Array, Array, Array], Array]) -> Callable[..., tuple[Array, Array, Array]]:
    """(q, k, v, dout) -> (dq, dk, dv): one forward and one backward pass."""

    def run(q: Array, k: Array, v: Array, do: Array) -> tuple[Array, Array, Array]:
        _, vjp = jax.vjp(fn, q, k, v)
        return vjp(do)

    return run


def peak_bytes(compiled: jax.stages.Compiled) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(
        stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    )


def time_ms(compiled: jax.stages.Compiled, args: tuple, runs: int) -> float:
    """Median wall time of `runs` calls after one warm-up call."""
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(
    impl: str,
    *,
    batch: int,
    heads: int,
    seq_len: int,
    head_dim: int,
    causal: bool,
    dtype: str,
    runs: int,
    max_bytes: float,
    seed: int = 0,
    impl_kwargs: dict | None = None,
) -> dict:
    """One JSON record: fwd and fwd+bwd time, TFLOP/s and peak memory, or why it was skipped."""
    record = dict(
        impl=impl,
        seq_len=seq_len,
        head_dim=head_dim,
        causal=causal,
        dtype=dtype,
        batch=batch,
        heads=heads,
        platform=jax.default_backend(),
    )
    shape = (batch, seq_len, heads, head_dim)
    spec = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    fn = attention_fn(impl, causal, **(impl_kwargs or {}))
    try:
        fwd = jax.jit(fn).lower(spec, spec, spec).compile()
        bwd = jax.jit(fwd_bwd_fn(fn)).lower(spec, spec, spec, spec).compile()
    except Exception as e:  # an unsupported combination is a result too
        record["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        return record
    record["peak_bytes_fwd"] = peak_bytes(fwd)
    record["peak_bytes_fwd_bwd"] = peak_bytes(bwd)
    if max(record["peak_bytes_fwd"] or 0, record["peak_bytes_fwd_bwd"] or 0) > max_bytes:
        record["skipped"] = f"compiled peak memory above {max_bytes / GIB:.1f} GiB; not run"
        return record
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
    f = flops(batch, heads, seq_len, seq_len, head_dim, causal)
    record["fwd_ms"] = round(time_ms(fwd, (q, k, v), runs), 3)
    record["fwd_bwd_ms"] = round(time_ms(bwd, (q, k, v, do), runs), 3)
    record["fwd_tflops"] = round(f / record["fwd_ms"] / 1e9, 4)
    record["fwd_bwd_tflops"] = round(FWD_BWD_FACTOR * f / record["fwd_bwd_ms"] / 1e9, 4)
    return record


def summary(records: list[dict]) -> dict:
    """Blockwise memory growth from 4k to 32k tokens, and blockwise time over the reference's where both ran."""
    by_key = {(r["impl"], r["seq_len"], r["head_dim"], r["causal"], r["dtype"]): r for r in records}
    out: dict = {"summary": True}
    for impl in sorted({r["impl"] for r in records}):
        small = [r for r in records if r["impl"] == impl and r["seq_len"] == 4096 and r.get("peak_bytes_fwd_bwd")]
        for r in small:
            big = by_key.get((impl, 32768, r["head_dim"], r["causal"], r["dtype"]))
            if big and big.get("peak_bytes_fwd_bwd"):
                name = f"{impl}_memory_ratio_32k_over_4k_hd{r['head_dim']}_causal{int(r['causal'])}_{r['dtype']}"
                out[name] = {
                    "fwd": round(big["peak_bytes_fwd"] / r["peak_bytes_fwd"], 2),
                    "fwd_bwd": round(big["peak_bytes_fwd_bwd"] / r["peak_bytes_fwd_bwd"], 2),
                }
    ratios = {}
    for (impl, seq_len, head_dim, causal, dtype), r in sorted(by_key.items(), key=lambda kv: str(kv[0])):
        ref = by_key.get(("xla", seq_len, head_dim, causal, dtype))
        if impl == "xla" or ref is None or "fwd_ms" not in r or "fwd_ms" not in ref:
            continue
        ratios[f"{impl}_over_xla_T{seq_len}_hd{head_dim}_causal{int(causal)}_{dtype}"] = {
            "fwd": round(r["fwd_ms"] / ref["fwd_ms"], 3),
            "fwd_bwd": round(r["fwd_bwd_ms"] / ref["fwd_bwd_ms"], 3),
        }
    out["time_ratios"] = ratios
    return out


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# GPU correctness cases: (name, B, T, S, N, K, H, D, mask kwargs builder); lengths are not multiples of tiles.
def _cases() -> list[tuple[str, int, int, int, int, int, int, int, Callable[[np.random.Generator], dict]]]:
    def packed(rng: np.random.Generator, batch: int, length: int) -> Array:
        """Sorted segment ids 1..4 with a padded (0) tail, like packed sequences."""
        ids = np.sort(rng.integers(1, 5, (batch, length)), axis=1)
        ids[:, length - length // 8 :] = 0
        return jnp.asarray(ids, jnp.int32)

    return [
        ("plain", 2, 1000, 1000, 4, 4, 64, 64, lambda rng: {}),
        ("causal_gqa_hd128", 1, 777, 777, 8, 2, 128, 128, lambda rng: dict(causal=True)),
        (
            "cross_causal_hd80_padding",
            2,
            300,
            1100,
            4,
            4,
            80,
            80,
            lambda rng: dict(causal=True, kv_segment_ids=packed(rng, 2, 1100).clip(0, 1)),
        ),
        (
            "window_packed",
            2,
            1500,
            1500,
            4,
            1,
            64,
            64,
            lambda rng: dict(causal=True, window=128, q_segment_ids=(s := packed(rng, 2, 1500)), kv_segment_ids=s),
        ),
        (
            "window_positions_hd256",
            1,
            640,
            640,
            2,
            2,
            256,
            256,
            lambda rng: dict(
                window=100,
                q_positions=jnp.asarray(rng.permutation(640)[None], jnp.int32),
                kv_positions=jnp.asarray(rng.permutation(640)[None], jnp.int32),
            ),
        ),
        ("value_dim_32", 1, 513, 513, 4, 4, 64, 32, lambda rng: dict(causal=True)),
        (
            "fully_masked_rows",
            1,
            256,
            256,
            2,
            2,
            64,
            64,
            lambda rng: dict(
                q_segment_ids=jnp.full((1, 256), 2, jnp.int32).at[:, :100].set(1),
                kv_segment_ids=jnp.ones((1, 256), jnp.int32),
            ),
        ),
    ]


# Normalised max error (max |x - ref| / max |ref|) allowed, by input dtype: float32 kernels use IEEE dots;
# bfloat16 keeps 8 bits of mantissa (P and dS are rounded to it before their matmuls), float16 keeps 11.
TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 3e-2}


def _errors(impl: str, dtype: str, case: tuple) -> dict:
    name, batch, q_len, kv_len, heads, kv_heads, head_dim, value_dim, make_kwargs = case
    rng = np.random.default_rng(0)
    kwargs = make_kwargs(rng)
    q, k, v, do = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in (
            (batch, q_len, heads, head_dim),
            (batch, kv_len, kv_heads, head_dim),
            (batch, kv_len, kv_heads, value_dim),
            (batch, q_len, heads, value_dim),
        )
    )

    def grads(impl: str, q: Array, k: Array, v: Array) -> tuple:
        out, vjp = jax.vjp(lambda q, k, v: ops.attention(q, k, v, impl=impl, **kwargs), q, k, v)
        return (out, *vjp(do.astype(out.dtype)))

    with jax.default_matmul_precision("highest"):
        ref = jax.jit(lambda q, k, v: grads("xla", q, k, v))(q, k, v)
    got = jax.jit(lambda q, k, v: grads(impl, q, k, v))(*(x.astype(dtype) for x in (q, k, v)))
    errors = {}
    for label, r, g in zip(("out", "dq", "dk", "dv"), ref, got, strict=True):
        g = g.astype(jnp.float32)
        finite = bool(jnp.all(jnp.isfinite(g)))
        errors[label] = float(jnp.max(jnp.abs(g - r)) / (jnp.max(jnp.abs(r)) + 1e-6)) if finite else float("inf")
    return errors


def correctness_report() -> list[dict]:
    """pallas (and cudnn where it applies) against the float32 xla reference on GPU: values and gradients."""
    records = []
    for case in _cases():
        for impl in ("pallas", "cudnn"):
            for dtype in ("bfloat16", "float16", "float32"):
                record = dict(check="correctness", impl=impl, case=case[0], dtype=dtype, tolerance=TOLERANCE[dtype])
                try:
                    errors = _errors(impl, dtype, case)
                    record.update(errors=errors, ok=all(e <= TOLERANCE[dtype] for e in errors.values()))
                except ValueError as e:  # unsupported combination, e.g. cudnn with segment ids
                    record["skipped"] = str(e).splitlines()[0][:200]
                records.append(record)
                emit(record)
    return records


# Tile candidates timed at 16k tokens, head dim 128 when the device report has time left (the defaults are
# untuned guesses): (fwd_q, fwd_k, dkdv_q, dkdv_k, dq_q, dq_k, fwd_warps, bwd_warps, fwd_stages, bwd_stages).
BLOCK_CANDIDATES = [
    (128, 64, 32, 128, 128, 32, 8, 8, 3, 2),
    (128, 64, 32, 128, 128, 32, 4, 4, 3, 3),
    (128, 128, 64, 128, 128, 64, 8, 8, 2, 2),
    (64, 64, 64, 64, 64, 64, 4, 4, 3, 3),
    (128, 32, 32, 64, 64, 32, 4, 4, 4, 3),
]


def device_report(impls: list[str], seq_lens: list[int], runs: int, max_gib: float, budget_s: float) -> None:
    """Everything a GPU session needs in one call: correctness, throughput of each implementation, a tile sweep.

    Ordered by importance, and stops starting measurements after `budget_s` seconds, so that a fixed device
    allowance always yields the correctness table and the 16k-token numbers the targets are stated for.
    """
    from transformer_jax.ops.pallas_gpu import BlockSizes

    start = time.time()
    emit(dict(device=str(jax.devices()[0]), jax=jax.__version__, budget_s=budget_s))
    checks = correctness_report()
    emit(dict(check="correctness_summary", failures=[c for c in checks if c.get("ok") is False]))
    impls = impls or ["pallas", "cudnn", "jax_pallas", "xla"]
    jobs = [
        (impl, seq_len, head_dim, causal, {})
        for head_dim in (128, 64)
        for seq_len in sorted(seq_lens, reverse=True)
        for causal in (False, True)
        for impl in impls
    ]
    jobs += [(f"pallas_tiles{i}", 16384, 128, False, dict(block_sizes=BlockSizes(*c)))
             for i, c in enumerate(BLOCK_CANDIDATES)]  # fmt: skip
    records = []
    for name, seq_len, head_dim, causal, impl_kwargs in jobs:
        if time.time() - start > budget_s:
            emit(dict(impl=name, seq_len=seq_len, head_dim=head_dim, causal=causal, skipped="time budget"))
            continue
        # FlashAttention's benchmark convention: 16k tokens per batch, model width 2048.
        record = measure(
            name.split("_tiles")[0],
            batch=max(1, 16384 // seq_len),
            heads=2048 // head_dim,
            seq_len=seq_len,
            head_dim=head_dim,
            causal=causal,
            dtype="bfloat16",
            runs=runs,
            max_bytes=max_gib * GIB,
            impl_kwargs=impl_kwargs,
        )
        record["impl"] = name
        if impl_kwargs:
            record["block_sizes"] = dataclasses.asdict(impl_kwargs["block_sizes"])
        records.append(record)
        emit(record)
    targets = {}
    for causal in (False, True):
        found = {
            r["impl"]: r
            for r in records
            if r["seq_len"] == 16384 and r["head_dim"] == 128 and r["causal"] == causal and "fwd_ms" in r
        }
        if "pallas" in found:
            targets[f"pallas_fwd_bwd_tflops_16k_hd128_causal{int(causal)}"] = found["pallas"]["fwd_bwd_tflops"]
            targets[f"target_300_met_causal{int(causal)}"] = found["pallas"]["fwd_bwd_tflops"] >= 300
        if "pallas" in found and "cudnn" in found:
            ratio = found["pallas"]["fwd_tflops"] / found["cudnn"]["fwd_tflops"]
            targets[f"pallas_fwd_over_cudnn_causal{int(causal)}"] = round(ratio, 3)
            targets[f"target_0.8x_cudnn_met_causal{int(causal)}"] = ratio >= 0.8
    emit(dict(summary(records), elapsed_s=round(time.time() - start, 1), targets=targets))


_IMPLS = flags.DEFINE_list("impls", [], "Implementations; default xla,blockwise (CPU), all four (--device_report).")
_SEQ_LENS = flags.DEFINE_list("seq_lens", [], "Token counts (T = S); default 1024 ... 32768 (16384: --device_report).")
_HEAD_DIMS = flags.DEFINE_list("head_dims", ["64"], "Head dims H.")
_CAUSAL = flags.DEFINE_list("causal", ["false"], "false, true or both.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32"], "Dtypes of q, k, v.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch rows B.")
_HEADS = flags.DEFINE_integer("heads", 1, "Heads N.")
_RUNS = flags.DEFINE_integer("runs", 3, "Timed runs after one warm-up; the median is reported.")
_MAX_GIB = flags.DEFINE_float("max_gib", 20.0, "Do not run programs whose peak is above this.")
_DEVICE_REPORT = flags.DEFINE_bool("device_report", False, "The whole GPU check in one call.")
_TPU_TOPOLOGY = flags.DEFINE_string(
    "tpu_topology", None, "Compile for one chip of this TPU slice (e.g. v5e:2x2) and print compiler estimates."
)
_GPU_TARGET = flags.DEFINE_string(
    "gpu_target", None, "Compile for one GPU of this kind (h100, h200) and print compiler estimates."
)
_BUDGET_S = flags.DEFINE_float("budget_s", 420.0, "--device_report: stop timing after this many seconds.")


def _ints(flag: str, values: list[str]) -> list[int]:
    try:
        return [int(v) for v in values]
    except ValueError as e:
        raise ConfigError(f"--{flag}: expected integers separated by commas, got {','.join(values)}") from e


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    np.set_printoptions(precision=4)
    seq_lens = _ints("seq_lens", _SEQ_LENS.value)
    if _TPU_TOPOLOGY.value:
        attention_tpu.report(
            _TPU_TOPOLOGY.value,
            seq_lens or [2048, 4096, 8192, 16384, 32768],
            _ints("head_dims", _HEAD_DIMS.value if _HEAD_DIMS.present else ["64", "128"]),
            _IMPLS.value or list(attention_tpu.IMPLS),
            list(attention_tpu.MASKS),
        )
        return
    if _GPU_TARGET.value:
        attention_gpu.report(
            _GPU_TARGET.value,
            seq_lens or [2048, 4096, 8192, 16384, 32768],
            _ints("head_dims", _HEAD_DIMS.value if _HEAD_DIMS.present else ["64", "128"]),
            _IMPLS.value or list(attention_gpu.IMPLS),
        )
        return
    if _DEVICE_REPORT.value:
        seq_lens = seq_lens or [1024, 2048, 4096, 8192, 16384]
        device_report(_IMPLS.value, seq_lens, _RUNS.value, _MAX_GIB.value, _BUDGET_S.value)
        return
    impls = _IMPLS.value or ["xla", "blockwise"]
    seq_lens = seq_lens or [1024, 2048, 4096, 8192, 16384, 32768]
    records = []
    for dtype in _DTYPES.value:
        for head_dim in _ints("head_dims", _HEAD_DIMS.value):
            for causal in (c.strip().lower() == "true" for c in _CAUSAL.value):
                for seq_len in seq_lens:
                    for impl in impls:
                        record = measure(
                            impl,
                            batch=_BATCH.value,
                            heads=_HEADS.value,
                            seq_len=seq_len,
                            head_dim=head_dim,
                            causal=causal,
                            dtype=dtype,
                            runs=_RUNS.value,
                            max_bytes=_MAX_GIB.value * GIB,
                        )
                        records.append(record)
                        emit(record)
    emit(summary(records))


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.attention")
