"""Train-step throughput of a config on random tokens, against torch.nn.Transformer with the same sizes.

python -m benchmarks.train_step --config configs/multi30k.py --config.data.batch_size=64 --config.data.max_len=32

Prints one JSON line: tokens_per_s, step_s, params, flops_per_step, mfu against a measured matmul peak, XLA's
estimate of the compiled step's FLOPs and bytes accessed, and the same for PyTorch (shared embeddings, tied
output, label smoothing, Adam, dropout on), measured in the same run, interleaved so that machine noise hits both
alike.

python -m benchmarks.train_step --config configs/multilingual.py:size=mini --torch=false \
    --config.opt.lora_rank=8 --config.opt.lora_targets=q,k,v,o,ffn --config.train.init_from=unused

times LoRA steps on a random base (the config's checks ask for train.init_from; the benchmark never reads it).

python -m benchmarks.train_step --config configs/multi30k.py:size=small --fresh_process

times train.py restarts from a checkpoint to their first step, with the compilation cache off and warm
(benchmarks/fresh_process.py); the --config and --config.* arguments go to train.py as given.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import numpy as np
from absl import flags
from flax import nnx
from ml_collections import config_flags

from benchmarks import fresh_process
from transformer_jax import cli
from transformer_jax.model import TransformerSpec
from transformer_jax.sharding import make_mesh
from transformer_jax.training.metrics import measure_matmul_peak, train_step_flops
from transformer_jax.training.step import compile_steps, create_train_state

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds of JAX and PyTorch.")
_TORCH = flags.DEFINE_bool("torch", True, "Also time torch.nn.Transformer.")
_FRESH = flags.DEFINE_bool(
    "fresh_process", False, "Time train.py restarts to their first step, cache off vs warm (fresh_process.py)."
)
_REPEATS = flags.DEFINE_integer("repeats", 2, "--fresh_process: restarts of each kind, alternating.")


def random_batch(rows: int, src_len: int, tgt_len: int, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Unpadded rows of random tokens in the data contract."""
    rng = np.random.default_rng(seed)
    tgt = rng.integers(4, vocab, (rows, tgt_len))
    return {
        "src_tokens": rng.integers(4, vocab, (rows, src_len)),
        "src_segment_ids": np.ones((rows, src_len)),
        "src_positions": np.tile(np.arange(src_len), (rows, 1)),
        "tgt_in": np.concatenate([np.full((rows, 1), 2), tgt[:, :-1]], 1),
        "tgt_out": tgt,
        "tgt_segment_ids": np.ones((rows, tgt_len)),
        "tgt_positions": np.tile(np.arange(tgt_len), (rows, 1)),
    }


def jax_stepper(config, batch):
    graphs, state = create_train_state(config)
    step, _, shardings = compile_steps(
        graphs,
        state,
        make_mesh(),
        config.train.mesh,
        label_smoothing=config.train.label_smoothing,
        accum_steps=config.train.grad_accum_steps,
    )
    holder = {"state": jax.device_put(state, shardings)}
    device_batch = {k: jax.numpy.asarray(v, jax.numpy.int32) for k, v in batch.items()}
    compiled = step.lower(holder["state"], device_batch).compile()
    cost = compiled.cost_analysis() or {}

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            holder["state"], metrics = compiled(holder["state"], device_batch)
        jax.block_until_ready(metrics)
        return (time.perf_counter() - start) / n

    params = sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(holder["state"])["model"]) if hasattr(x, "size"))
    # XLA's own count of the compiled step, an estimate (it counts the ops the formula leaves out, and its bytes
    # are what each op reads and writes, not what reaches memory past the caches).
    estimate = {"flops": cost.get("flops"), "bytes_accessed": cost.get("bytes accessed")}
    return run, params, estimate


def torch_stepper(spec: TransformerSpec, batch, label_smoothing: float, opt):
    import torch  # the reference (requirements-dev.txt); only this comparison needs it

    d, vocab = spec.d_model, spec.vocab_size
    torch.manual_seed(0)

    class TorchModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, d)
            self.core = torch.nn.Transformer(
                d_model=d,
                nhead=spec.num_heads,
                num_encoder_layers=spec.num_encoder_layers,
                num_decoder_layers=spec.num_decoder_layers,
                dim_feedforward=spec.d_ff,
                dropout=spec.dropout_rate,
                batch_first=True,
            )
            self.drop = torch.nn.Dropout(spec.dropout_rate)
            pos = np.arange(1024)[:, None] / 10000 ** (np.arange(0, d, 2)[None] / d)
            pe = np.zeros((1024, d), np.float32)
            pe[:, 0::2], pe[:, 1::2] = np.sin(pos), np.cos(pos)
            self.register_buffer("pe", torch.from_numpy(pe))

        def forward(self, src, tgt):
            scale = d**0.5
            x = self.drop(self.embed(src) * scale + self.pe[: src.shape[1]])
            y = self.drop(self.embed(tgt) * scale + self.pe[: tgt.shape[1]])
            mask = torch.nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
            out = self.core(x, y, tgt_mask=mask, tgt_is_causal=True)
            return out @ self.embed.weight.T  # tied output projection

    model = TorchModel()
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(opt.b1, opt.b2), eps=opt.eps)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=label_smoothing, ignore_index=0)
    src = torch.from_numpy(batch["src_tokens"].astype(np.int64))
    tgt_in = torch.from_numpy(batch["tgt_in"].astype(np.int64))
    tgt_out = torch.from_numpy(batch["tgt_out"].astype(np.int64))

    def run(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            optimizer.zero_grad(set_to_none=True)
            logits = model(src, tgt_in)
            loss = loss_fn(logits.reshape(-1, vocab), tgt_out.reshape(-1))
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - start) / n

    return run, sum(p.numel() for p in model.parameters())


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    if _FRESH.value:
        print(json.dumps(fresh_process.restart_times(fresh_process.config_arguments(sys.argv[1:]), _REPEATS.value)))
        return
    config = _CONFIG.value
    # As train.py: list-valued overrides (--config.opt.lora_targets=q,k,v) become their tuples, and every key is
    # checked; unchecked, a comma-joined value would reach the model as one string.
    cli.validate(config)
    spec = TransformerSpec.from_config(config)
    rows, length = config.data.batch_size, config.data.max_len
    batch = random_batch(rows, length, length, spec.vocab_size)
    tokens = 2 * rows * length  # source + target, all real
    step_flops = train_step_flops(spec, rows, length, length)
    peak = measure_matmul_peak()
    jax_run, jax_params, xla_estimate = jax_stepper(config, batch)
    jax_run(2)  # warm-up (jax_stepper compiled the step)
    runners = {"jax": jax_run}
    params = {"jax": jax_params}
    if _TORCH.value:
        torch_run, params["torch"] = torch_stepper(spec, batch, config.train.label_smoothing, config.opt)
        torch_run(2)
        runners["torch"] = torch_run
    times = {name: [] for name in runners}
    for _ in range(_ROUNDS.value):
        for name, run in runners.items():
            times[name].append(run(_STEPS.value))
    result = {
        "config": {
            "d_model": spec.d_model,
            "heads": spec.num_heads,
            "d_ff": spec.d_ff,
            "layers": [spec.num_encoder_layers, spec.num_decoder_layers],
            "vocab": spec.vocab_size,
            "batch": [rows, length, length],
            "dtype": spec.dtype,
        },
        "flops_per_step": step_flops,
        "matmul_peak_flops": peak,
        "device": str(jax.devices()[0].device_kind),
        "xla_estimate_per_step": xla_estimate,
    }
    for name in runners:
        step_s = statistics.median(times[name])
        result[name] = {
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "params": params[name],
            "achieved_flops": step_flops / step_s,
            "mfu": step_flops / step_s / peak,
            "step_s_all_rounds": times[name],
        }
    if "torch" in result:
        result["jax_over_torch_throughput"] = result["torch"]["step_s"] / result["jax"]["step_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    cli.run(main, "python -m benchmarks.train_step")
