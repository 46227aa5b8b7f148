"""transformers' M2M-100 / NLLB-200 as the reference, run in a process of its own (torch never enters a pytest
process: tests/helpers/marian_reference.py says why):

    make DIR JSON          a random-weight M2M100ForConditionalGeneration saved in DIR with its tokenizer, offline:
                           a small SentencePiece BPE model trained here (unk 0, bos 1, eos 2, as NLLB's and
                           M2M-100's are), JSON {"family": "nllb"|"m2m100", ...config overrides}. nllb: an
                           NllbTokenizer (tokenizer.json: ids from its vocabulary and added tokens) and 2 embedding
                           rows more than it has ids; m2m100: an M2M100Tokenizer (vocab.json, the 100 __xx__ codes
                           and 8 madeup words after it). Random LayerNorm weights and biases, so that no norm is
                           the identity.
    logits DIR IN OUT      the model's logits for IN's (src, tgt) arrays (.npz) -> OUT
    generate DIR IN OUT J  generate() outputs for IN's src array (.npz) -> OUT (.json); J: generate's arguments
    tokenize DIR IN OUT L  the tokenizer's source ids (src_lang L, special tokens added) of IN's sentences (.json)
    make_ct2 DIR JSON OUT  `make`, then CTranslate2's own converter (TransformersConverter) writes DIR's model to OUT
    translate DIR IN OUT N S T
                           greedy translations of IN's lines from language code S into T -> OUT (text), one
                           sentence at a time, forced_bos_token_id T, each capped at its source's token count + N
                           tokens (evaluate.py's --max_extra_len), language codes and pad suppressed (as our search
                           never emits them)
    translate_plain DIR IN OUT N T
                           as translate, for a model of ours with model.lang_token=target (sources carry no code):
                           the tokenizer is DIR's tokenizer.json as it is (PreTrainedTokenizerFast), `X </s>`
    tokenize_plain DIR IN OUT
                           IN's sentences (.json) without specials by AutoTokenizer and by DIR's tokenizer.json as it
                           is (with its post-processor), and the latter's decoding of its ids -> OUT (.json)
    spm_to_bpe SPM OUT     transformers' own conversion of a SentencePiece BPE model (SentencePieceExtractor): its
                           vocab and merges -> OUT (.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from marian_reference import ROOT, SENTENCES, run_script  # noqa: E402  (a file run as a script: its folder's neighbour)

__all__ = ["FOLDERS", "ROOT", "ct2_oracle", "run"]

# `make`'s settings of the two families' folders (tests/conftest.py's nllb_dir and m2m_dir).
FOLDERS = {"nllb": {"family": "nllb"}, "m2m100": {"family": "m2m100", "seed": 1}}


def ct2_oracle(folder: Path) -> Path:
    """Where CTranslate2's own conversion of a conftest folder lies (`make_ct2` writes it beside the folder)."""
    return folder.with_name("ct2")


def run(*args: str, timeout: int = 300) -> str:
    """Runs this module with `args` in a fresh process; its stdout (AssertionError with the output on failure)."""
    return run_script(__file__, *args, timeout=timeout)


def _spm(prefix: Path, vocab_size: int) -> Path:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        hard_vocab_limit=False,
    )
    Path(f"{prefix}.vocab").unlink()
    return Path(f"{prefix}.model")


def _tokenizer(out: Path, family: str):
    """The family's tokenizer, saved in `out`; returns it."""
    import sentencepiece as spm

    model = _spm(out / "sentencepiece.bpe", 80)
    if family == "nllb":
        from transformers import NllbTokenizer
        from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

        # Without the codes listed, NllbTokenizer adds none of them.
        settings = {"tokenizer_class": "NllbTokenizer", "additional_special_tokens": FAIRSEQ_LANGUAGE_CODES}
        (out / "tokenizer_config.json").write_text(json.dumps(settings))
        tokenizer = NllbTokenizer.from_pretrained(str(out), src_lang="eng_Latn", tgt_lang="deu_Latn")
    else:
        from transformers import M2M100Tokenizer

        sp = spm.SentencePieceProcessor(model_file=str(model))
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for i in range(sp.get_piece_size()):
            vocab.setdefault(sp.id_to_piece(i), len(vocab))
        (out / "vocab.json").write_text(json.dumps(vocab))
        tokenizer = M2M100Tokenizer(str(out / "vocab.json"), str(model), src_lang="en", tgt_lang="de")
    tokenizer.save_pretrained(str(out))
    return tokenizer


def make(directory: str, overrides: dict) -> None:
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    family = overrides.pop("family", "nllb")
    tokenizer = _tokenizer(out, family)
    if family == "nllb":
        rows = len(tokenizer) + 2  # NLLB-200's checkpoints have 2 rows more than its tokenizer has ids
    else:  # vocab.json, the language codes, the madeup words (len(M2M100Tokenizer) counts only vocab.json)
        rows = tokenizer.vocab_size + len(tokenizer.lang_code_to_id) + tokenizer.num_madeup_words
    config = dict(
        vocab_size=rows,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        activation_function="relu",
        scale_embedding=True,
        max_position_embeddings=128,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        dropout=0.1,
        attention_dropout=0.1,
    )
    config.update(overrides)
    torch.manual_seed(config.pop("seed", 0))
    model = M2M100ForConditionalGeneration(M2M100Config(**config)).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.2)
                module.bias.normal_(0.0, 0.2)
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.1)
    model.generation_config.num_beams = 2
    model.generation_config.max_length = 30
    model.save_pretrained(out)


def logits(directory: str, inputs: str, output: str) -> None:
    import torch
    from transformers import M2M100ForConditionalGeneration

    model = M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    arrays = np.load(inputs)
    src, tgt = torch.from_numpy(arrays["src"]).long(), torch.from_numpy(arrays["tgt"]).long()
    with torch.no_grad():
        out = model(input_ids=src, attention_mask=src != model.config.pad_token_id, decoder_input_ids=tgt).logits
    np.savez(output, logits=out.numpy())


def generate(directory: str, inputs: str, output: str, arguments: str) -> None:
    import torch
    from transformers import M2M100ForConditionalGeneration

    model = M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    src = torch.from_numpy(np.load(inputs)["src"]).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=src, attention_mask=src != model.config.pad_token_id, do_sample=False, **json.loads(arguments)
        )
    Path(output).write_text(json.dumps(out.tolist()))


def tokenize(directory: str, sentences: str, output: str, src_lang: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, src_lang=src_lang)
    ids = [tokenizer(s)["input_ids"] for s in json.loads(Path(sentences).read_text())]
    Path(output).write_text(json.dumps(ids))


def translate(directory: str, sentences: str, output: str, max_extra: str, src_lang: str, tgt_lang: str) -> None:
    _translate(directory, sentences, output, max_extra, tgt_lang, src_lang)


def translate_plain(directory: str, sentences: str, output: str, max_extra: str, tgt_lang: str) -> None:
    _translate(directory, sentences, output, max_extra, tgt_lang, None)


def _translate(directory: str, sentences: str, output: str, max_extra: str, tgt_lang: str, src_lang) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        LogitsProcessor,
        LogitsProcessorList,
        M2M100ForConditionalGeneration,
        PreTrainedTokenizerFast,
    )

    if src_lang is None:
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(directory) / "tokenizer.json"))
    else:
        tokenizer = AutoTokenizer.from_pretrained(directory, src_lang=src_lang)
    model = M2M100ForConditionalGeneration.from_pretrained(directory).eval()
    specials = ("<s>", "</s>", "<unk>", "<mask>")
    if hasattr(tokenizer, "lang_token_to_id"):  # M2M100Tokenizer keeps its codes out of the added vocabulary
        codes = list(tokenizer.lang_token_to_id.values())
    else:
        codes = [i for token, i in tokenizer.get_added_vocab().items() if token not in specials]

    class NoCodeAfterTheForcedOne(LogitsProcessor):  # generate() refuses to suppress a token it also forces
        def __call__(self, input_ids, scores):
            scores[:, model.config.pad_token_id] = -float("inf")
            if input_ids.shape[1] > 1:
                scores[:, codes] = -float("inf")
            return scores

    out = []
    for line in Path(sentences).read_text(encoding="utf-8").splitlines():
        ids = tokenizer(line, return_tensors="pt").input_ids
        with torch.no_grad():
            tokens = model.generate(
                ids,
                num_beams=1,
                do_sample=False,
                max_new_tokens=ids.shape[1] + int(max_extra),
                forced_bos_token_id=tokenizer.convert_tokens_to_ids(tgt_lang),
                forced_eos_token_id=None,
                logits_processor=LogitsProcessorList([NoCodeAfterTheForcedOne()]),
            )
        out.append(tokenizer.decode(tokens[0], skip_special_tokens=True))
    Path(output).write_text("".join(line + "\n" for line in out), encoding="utf-8")


def _converter(directory: str):
    """CTranslate2's TransformersConverter, given M2M100Tokenizer as transformers 4 built it: with its codes among the
    additional_special_tokens, where the converter's M2M-100 loader looks for them (transformers 5 lists none, and the
    converter would then leave the 100 codes out of the vocabulary and refuse the model)."""
    from ctranslate2.converters import TransformersConverter

    class Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            tokenizer = super().load_tokenizer(tokenizer_class, model_name_or_path, **kwargs)
            codes = list(getattr(tokenizer, "lang_token_to_id", {}))
            if codes:
                base = type(tokenizer)
                listed = property(lambda t: {**base.special_tokens_map.fget(t), "additional_special_tokens": codes})
                tokenizer.__class__ = type(base.__name__, (base,), {"special_tokens_map": listed})
            return tokenizer

    return Converter(directory)


def make_ct2(directory: str, overrides: dict, output: str) -> None:
    """`make`, then CTranslate2's converter on the folder (one process: both import torch and transformers)."""
    make(directory, dict(overrides))
    _converter(directory).convert(output)


def tokenize_plain(directory: str, sentences: str, output: str) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    auto = AutoTokenizer.from_pretrained(directory)
    plain = PreTrainedTokenizerFast(tokenizer_file=str(Path(directory) / "tokenizer.json"))
    lines = json.loads(Path(sentences).read_text())
    ids = [plain(s).input_ids for s in lines]
    out = {
        "auto": [auto(s, add_special_tokens=False).input_ids for s in lines],
        "file": ids,
        "decoded": [plain.decode(x, skip_special_tokens=True) for x in ids],
    }
    Path(output).write_text(json.dumps(out, ensure_ascii=False))


def spm_to_bpe(model: str, output: str) -> None:
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    extracted = SentencePieceExtractor(model).extract(BPE)
    merges = [list(merge) for merge in extracted["merges"]]
    Path(output).write_text(json.dumps({"vocab": extracted["vocab"], "merges": merges}, ensure_ascii=False))


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    commands = {
        "logits": logits,
        "generate": generate,
        "tokenize": tokenize,
        "translate": translate,
        "translate_plain": translate_plain,
        "tokenize_plain": tokenize_plain,
        "spm_to_bpe": spm_to_bpe,
    }
    if command == "make":
        make(rest[0], json.loads(rest[1]) if len(rest) > 1 else {})
    elif command == "make_ct2":
        make_ct2(rest[0], json.loads(rest[1]), rest[2])
    elif command in commands:
        commands[command](*rest)
    else:
        raise SystemExit(f"unknown command {command!r}")
