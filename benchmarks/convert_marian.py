"""Converting an OPUS-MT model of opus-mt-en-de's shapes: time and memory of `python -m transformer_jax.convert`.

    python -m benchmarks.convert_marian [--keep DIR]

A random-weight Marian folder of Helsinki-NLP/opus-mt-en-de's shapes (d_model 512, 6 + 6 layers, 8 heads, FFN 2048,
vocabulary 58,101, shared and tied embeddings) is written as safetensors (no torch) in a temporary directory,
with a vocab.json of 58,101 pieces and a small SentencePiece model as source.spm and target.spm. It is then
converted twice in fresh processes:
- `cli_seconds`: the command line itself, timed from the process's start to its exit;
- `convert_seconds`, `rss_after_imports_mib`, `peak_rss_mib`: the same library calls (folder.read_folder and
  write_workdir) in a process that reads its RSS (/proc/self/status VmRSS) once its imports are done and jax's CPU
  backend has started (about 350 MiB of jaxlib's code and the client, paid by every jax process whatever it
  converts), and its peak (VmHWM) at the end; `peak_minus_base_over_weights` = (peak - that RSS) / the weights'
  bytes.
Targets (issue 47): under 30 s, and peak - base under 2x the weights. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SHAPES = dict(d_model=512, layers=6, heads=8, ffn=2048, vocab=58101)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def write_folder(path: Path, seed: int = 0) -> int:
    """A random Marian folder of opus-mt-en-de's shapes at `path`; returns the weights' bytes."""
    import sentencepiece as spm
    from safetensors.numpy import save_file

    from transformer_jax.interop import marian
    from transformer_jax.model import TransformerSpec

    s = SHAPES
    hf = {
        "model_type": "marian",
        "architectures": ["MarianMTModel"],
        "vocab_size": s["vocab"],
        "decoder_vocab_size": s["vocab"],
        "d_model": s["d_model"],
        "encoder_layers": s["layers"],
        "decoder_layers": s["layers"],
        "encoder_attention_heads": s["heads"],
        "decoder_attention_heads": s["heads"],
        "encoder_ffn_dim": s["ffn"],
        "decoder_ffn_dim": s["ffn"],
        "activation_function": "swish",
        "scale_embedding": True,
        "normalize_before": False,
        "static_position_embeddings": True,
        "max_position_embeddings": 512,
        "pad_token_id": s["vocab"] - 1,
        "decoder_start_token_id": s["vocab"] - 1,
        "eos_token_id": 0,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
    }
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hf))
    (path / "generation_config.json").write_text(json.dumps({"num_beams": 4, "max_length": 512}))
    sentences = [f"sentence number {i} with a few words" for i in range(200)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(path / "sp"), vocab_size=40, minloglevel=2
    )
    (path / "sp.model").rename(path / "source.spm")
    (path / "target.spm").write_bytes((path / "source.spm").read_bytes())
    (path / "sp.vocab").unlink()
    pieces = ["</s>", "<unk>"] + [f"piece{i}" for i in range(s["vocab"] - 3)] + ["<pad>"]
    (path / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    # The shapes come from the mapping table itself, for a spec of these sizes.
    from transformer_jax.config import schema

    config = schema.base_config("base")
    keys = marian.model_keys(hf, unk_id=1)
    for key, value in keys.items():
        group, leaf = key.split(".")
        config[group][leaf] = value
    spec = TransformerSpec.from_config(config)
    rng = np.random.default_rng(seed)
    d, f, v = s["d_model"], s["ffn"], s["vocab"]
    shapes = {"table_VD": (v, d), "final_logits_bias_V": (1, v)}
    tensors = {}
    for entry in marian.table(spec):
        leaf = entry.ours[-1]
        if leaf in shapes:
            shape = shapes[leaf]
        elif leaf == "kernel":
            parent = entry.ours[-2]
            shape = {"w1": (f, d), "w2": (d, f)}.get(parent, (d, d))  # Marian's [out, in]
        elif leaf == "bias":
            shape = (f,) if entry.ours[-2] == "w1" else (d,)
        else:
            shape = (d,)
        tensors[entry.marian] = rng.standard_normal(shape, dtype=np.float32) * 0.02
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.nbytes for t in tensors.values())


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS: now, VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(source: str, workdir: str) -> None:
    """The conversion in this (fresh) process, with its RSS after imports and its peak."""
    import jax
    import jax.numpy as jnp

    from transformer_jax import runtime

    runtime.use_cpu_without_accelerators()

    from transformer_jax.interop import marian_folder as folder

    jax.devices()
    (jnp.zeros(3) + 1).block_until_ready()
    base = _status("VmRSS")
    start = time.perf_counter()
    folder.write_workdir(folder.read_folder(source), workdir)
    seconds = time.perf_counter() - start
    print(json.dumps({"convert_seconds": seconds, "rss_after_imports": base, "peak_rss": _status("VmHWM")}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="write the folders here instead of a temporary directory")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.keep or tmp)
        weights = write_folder(root / "opus-mt-shapes")
        start = time.perf_counter()
        cli = [sys.executable, "-m", "transformer_jax.convert", "--from_marian", str(root / "opus-mt-shapes")]
        subprocess.run([*cli, "--workdir", str(root / "w_cli")], cwd=REPO, env=_env(), check=True, capture_output=True)
        cli_seconds = time.perf_counter() - start
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.convert_marian", "--child", str(root / "opus-mt-shapes")]
            + [str(root / "w_lib")],
            cwd=REPO,
            env=_env(),
            check=True,
            capture_output=True,
            text=True,
        )
        measured = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 1 << 20
    print(
        json.dumps(
            {
                "benchmark": "convert_marian",
                "shapes": SHAPES,
                "weights_mib": round(weights / mib, 1),
                "cli_seconds": round(cli_seconds, 2),
                "convert_seconds": round(measured["convert_seconds"], 2),
                "rss_after_imports_mib": round(measured["rss_after_imports"] / mib, 1),
                "peak_rss_mib": round(measured["peak_rss"] / mib, 1),
                "peak_minus_base_over_weights": round(
                    (measured["peak_rss"] - measured["rss_after_imports"]) / weights, 2
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
