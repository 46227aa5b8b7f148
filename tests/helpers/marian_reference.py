"""transformers' Marian as the reference, run in a process of its own (`python tests/helpers/marian_reference.py`).

torch is never imported into a pytest process (tests/test_torch_reference.py says why: after torch's kernels have
run, CTranslate2 in the same process finds other beams), so the tests call `run(...)`, which starts this module:

    make DIR JSON          a random-weight MarianMTModel and MarianTokenizer saved in DIR, offline: a small
                           SentencePiece model trained here, vocab.json with </s> 0, <unk> 1 and <pad> last,
                           swish, a non-zero final_logits_bias, random LayerNorm weights (JSON: config overrides;
                           "pickle": true saves pytorch_model.bin instead of model.safetensors)
    logits DIR IN OUT      MarianMTModel.from_pretrained(DIR) logits for IN's (src, tgt) arrays (.npz) -> OUT
    tokenize DIR IN OUT    MarianTokenizer.from_pretrained(DIR) ids of IN's sentences (.json) -> OUT (.json)
    generate DIR IN OUT J  generate() outputs for IN's src array (.npz) -> OUT (.json); J: generate's arguments
    translate DIR IN OUT N greedy translations of IN's lines (text) -> OUT (text), one sentence at a time, each
                           capped at its source's token count + N tokens (evaluate.py's --max_extra_len)
    train DIR DATA STEPS   a small MarianMTModel trained STEPS Adam steps on DATA/train.{en,de} (Multi30k), with a
                           SentencePiece model trained on it, saved in DIR: outputs that mean something
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SENTENCES = [
    "A man in a blue shirt is standing on a ladder cleaning windows.",
    "Two young children are playing in the sand near the water.",
    "A woman is riding a bicycle down a busy street in the city.",
    "The dog runs across the green field after a red ball.",
    "Several people are waiting at the bus stop in the rain.",
    "A group of friends sits around a table eating dinner.",
] * 4


def run(*args: str, timeout: int = 300) -> str:
    """Runs this module with `args` in a fresh process; its stdout (AssertionError with the output on failure)."""
    return run_script(__file__, *args, timeout=timeout)


def run_script(script: str, *args: str, timeout: int = 300) -> str:
    """Runs a reference `script` with `args` in a fresh process; its stdout (AssertionError with the output on
    failure)."""
    done = subprocess.run(
        # the file, not `-m tests.helpers...`: the helpers package imports jax, ~1.5 s this process never uses
        [sys.executable, script, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _train_spm(prefix: Path, vocab_size: int) -> list[str]:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="unigram",
        minloglevel=2,
        hard_vocab_limit=False,
    )
    sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def _vocab(pieces: list[str], extra: list[str]) -> dict[str, int]:
    """Marian's layout: </s> 0, <unk> 1, the pieces, `extra` (language tokens), <pad> last."""
    order = ["</s>", "<unk>"] + [p for p in pieces if p not in ("</s>", "<unk>", "<s>")] + extra + ["<pad>"]
    return {piece: i for i, piece in enumerate(order)}


def make(directory: str, overrides: dict) -> None:
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "spm"
    work.mkdir(exist_ok=True)
    separate = not overrides.get("share_encoder_decoder_embeddings", True)
    pickle = overrides.pop("pickle", False)
    extra = list(overrides.pop("language_tokens", []))
    source_vocab = _vocab(_train_spm(work / "source", 60), extra)
    target_vocab = _vocab(_train_spm(work / "target", 50), []) if separate else source_vocab
    (out / "source.spm").write_bytes((work / "source.model").read_bytes())
    (out / "target.spm").write_bytes((work / ("target" if separate else "source")).with_suffix(".model").read_bytes())
    for p in work.iterdir():
        p.unlink()
    work.rmdir()
    (out / "vocab.json").write_text(json.dumps(source_vocab))
    if separate:
        (out / "target_vocab.json").write_text(json.dumps(target_vocab))
    pad = len(target_vocab) - 1
    config = dict(
        vocab_size=len(source_vocab),
        decoder_vocab_size=len(target_vocab),
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        activation_function="swish",
        scale_embedding=True,
        max_position_embeddings=128,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        bos_token_id=0,
        share_encoder_decoder_embeddings=not separate,
    )
    config.update(overrides)
    torch.manual_seed(overrides.get("seed", 0))
    config.pop("seed", None)
    model = MarianMTModel(MarianConfig(**config)).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.5)
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.1)
    model.generation_config.num_beams = 3
    model.generation_config.max_length = 40
    model.generation_config.bad_words_ids = [[pad]]
    model.save_pretrained(out)
    if pickle:  # an older upload: the whole state dict (tied copies and position tables included) as a pickle
        torch.save(model.state_dict(), out / "pytorch_model.bin")
        (out / "model.safetensors").unlink()
    tokenizer = MarianTokenizer(
        str(out / "source.spm"),
        str(out / "target.spm"),
        str(out / "vocab.json"),
        target_vocab_file=str(out / "target_vocab.json") if separate else None,
        source_lang="en",
        target_lang="de",
        separate_vocabs=separate,
    )
    tokenizer.save_pretrained(out)


def logits(directory: str, inputs: str, output: str) -> None:
    import torch
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(directory).eval()
    arrays = np.load(inputs)
    src, tgt = torch.from_numpy(arrays["src"]).long(), torch.from_numpy(arrays["tgt"]).long()
    mask = src != model.config.pad_token_id
    with torch.no_grad():
        out = model(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    np.savez(output, logits=out.numpy())


def tokenize(directory: str, sentences: str, output: str) -> None:
    from transformers import MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(directory)
    ids = [tokenizer(s)["input_ids"] for s in json.loads(Path(sentences).read_text())]
    Path(output).write_text(json.dumps(ids))


def generate(directory: str, inputs: str, output: str, arguments: str) -> None:
    import torch
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(directory).eval()
    src = torch.from_numpy(np.load(inputs)["src"]).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=src, attention_mask=src != model.config.pad_token_id, do_sample=False, **json.loads(arguments)
        )
    Path(output).write_text(json.dumps(out.tolist()))


def translate(directory: str, sentences: str, output: str, max_extra: str) -> None:
    import torch
    from transformers import MarianMTModel, MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(directory)
    model = MarianMTModel.from_pretrained(directory).eval()
    out = []
    for line in Path(sentences).read_text(encoding="utf-8").splitlines():
        ids = tokenizer(line, return_tensors="pt").input_ids  # </s> appended, as our sources end with EOS
        with torch.no_grad():
            # No forced EOS at the cap: evaluate.py cuts a hypothesis there, it does not end it with EOS.
            cap = ids.shape[1] + int(max_extra)
            tokens = model.generate(ids, num_beams=1, do_sample=False, max_new_tokens=cap, forced_eos_token_id=None)
        out.append(tokenizer.decode(tokens[0], skip_special_tokens=True))
    Path(output).write_text("".join(line + "\n" for line in out), encoding="utf-8")


def train(directory: str, data: str, steps: str) -> None:
    import sentencepiece as spm
    import torch
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    out, data_dir = Path(directory), Path(data)
    out.mkdir(parents=True, exist_ok=True)
    en = (data_dir / "train.en").read_text().splitlines()[:8000]
    de = (data_dir / "train.de").read_text().splitlines()[:8000]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(en + de), model_prefix=str(out / "sp"), vocab_size=1000, minloglevel=2
    )
    sp = spm.SentencePieceProcessor(model_file=str(out / "sp.model"))
    vocab = _vocab([sp.id_to_piece(i) for i in range(sp.get_piece_size())], [])
    (out / "sp.model").rename(out / "source.spm")
    (out / "target.spm").write_bytes((out / "source.spm").read_bytes())
    (out / "sp.vocab").unlink()
    (out / "vocab.json").write_text(json.dumps(vocab))
    pad = len(vocab) - 1
    config = MarianConfig(
        vocab_size=len(vocab),
        decoder_vocab_size=len(vocab),
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        activation_function="swish",
        scale_embedding=True,
        max_position_embeddings=128,
        pad_token_id=pad,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        dropout=0.1,
    )
    torch.manual_seed(0)
    model = MarianMTModel(config)
    tokenizer = MarianTokenizer(
        str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json"), source_lang="en", target_lang="de"
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    model.train()
    for _ in range(int(steps)):
        rows = rng.integers(0, len(en), size=48)
        batch = tokenizer(
            [en[i] for i in rows],
            text_target=[de[i] for i in rows],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=40,
        )
        batch["labels"][batch["labels"] == pad] = -100
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"loss {loss.item():.3f}")
    model.eval()
    model.generation_config.bad_words_ids = [[pad]]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def encode(directory: str, sentences: str, output: str) -> None:
    """MarianTokenizer's padded source ids (.npz src) of the first lines of a text file."""
    from transformers import MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(directory)
    lines = Path(sentences).read_text().splitlines()[:100]
    np.savez(output, src=tokenizer(lines, padding=True, return_tensors="np")["input_ids"])


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "make":
        make(rest[0], json.loads(rest[1]) if len(rest) > 1 else {})
    elif command == "logits":
        logits(*rest)
    elif command == "tokenize":
        tokenize(*rest)
    elif command == "generate":
        generate(*rest)
    elif command == "translate":
        translate(*rest)
    elif command == "train":
        train(*rest)
    elif command == "encode":
        encode(*rest)
    else:
        raise SystemExit(f"unknown command {command!r}")
