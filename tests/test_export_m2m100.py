"""python -m transformer_jax.export --format m2m100: a folder M2M100ForConditionalGeneration and AutoTokenizer load
(transformers runs in a process of its own: tests/helpers/m2m100_reference.py). Converted workdirs go back to the
folders they came from; our own multilingual models export with their rows permuted into fairseq's order, their
tokenizer as a tokenizer.json giving our ids, and translate in transformers as evaluate.py does."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict

from tests.helpers import DATA
from tests.helpers.m2m100_reference import ROOT, run
from tests.helpers.marian_reference import SENTENCES
from transformer_jax.config import schema
from transformer_jax.data.tokenizer import train_tokenizer
from transformer_jax.errors import ConfigError, EvalError
from transformer_jax.evaluation.restore import CheckpointChoice, restore_model, workdir_tokenizer
from transformer_jax.interop import m2m100_export, m2m100_folder, marian_folder
from transformer_jax.model.layers import SpecialIds
from transformer_jax.training import checkpoints
from transformer_jax.training.step import new_train_state, split_train_state

PIECES = 400
LANGS = ("cs", "de", "en", "fr")  # their ids follow the pieces in this order: 400 .. 403
EXPORTABLE = dict(norm_position="pre", sinusoid_layout="fairseq", position_offset=2, norm_epsilon=1e-5)
LAST = CheckpointChoice(average_last=1)


def make_workdir(path: Path, lang_token: str = "source_and_target", langs=LANGS, seed: int = 0, **model) -> Path:
    """A workdir of our own multilingual model (a BPE spm.model trained here, the languages' ids after its pieces,
    a step-0 checkpoint) whose every parameter is random, LayerNorms and biases included."""
    data = path / "data"
    data.mkdir(parents=True)
    for lang in langs:
        (data / f"train.{lang}").write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    train_tokenizer(SENTENCES, path / "spm.model", vocab_size=PIECES, model_type="bpe", ids=SpecialIds.DEFAULT)
    config = schema.base_config("tiny")
    config.model.update(**{"vocab_size": PIECES + len(langs), "lang_token": lang_token, **EXPORTABLE, **model})
    config.data.update(source="text", text_dir=str(data), tokenizer_type="bpe", src_lang="", tgt_lang="")
    config.data.directions = tuple(f"{a}-{b}" for a in langs for b in langs if a != b)
    config.ckpt.async_save = False
    config.eval.average_last = 1
    _, state = split_train_state(new_train_state(config))
    pure = nnx.to_pure_dict(state)
    rng = np.random.default_rng(seed)

    def randomize(x):
        if x.dtype != jnp.float32:
            return x
        return jnp.asarray(rng.normal(1.0 if x.ndim == 1 else 0.0, 0.3, x.shape), jnp.float32)

    pure["model"] = jax.tree.map(randomize, pure["model"])
    nnx.replace_by_pure_dict(state, pure)
    saver = checkpoints.Checkpointer(path, config.ckpt)
    saver.save(0, state, None, config)
    saver.close()
    return path


def export(workdir: Path, output: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "transformer_jax.export", "--format", "m2m100", "--workdir", str(workdir)]
        + ["--output", str(output), "--average_last", "1", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )


def params_of(workdir: Path) -> dict:
    _, model, _ = restore_model(str(workdir), LAST)
    return {k: np.asarray(v) for k, v in flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param))).items()}


@pytest.mark.parametrize("family", ["nllb", pytest.param("m2m100", marks=pytest.mark.slow)])
def test_import_export_import_is_bit_identical(family, request, tmp_path):
    """A converted folder exported and converted again gives the same workdir: parameters, config (the code table
    in it) and tokenizer files; an NLLB folder's tokenizer.json comes back as transformers wrote it."""
    source = request.getfixturevalue("nllb_dir" if family == "nllb" else "m2m_dir")
    marian_folder.write_workdir(m2m100_folder.read_folder(source), tmp_path / "w1")
    report = m2m100_export.export_workdir(str(tmp_path / "w1"), tmp_path / "out", choice=LAST)
    assert report["format"] == "m2m100" and "epsilon_logit_difference" not in report
    marian_folder.write_workdir(m2m100_folder.read_folder(tmp_path / "out"), tmp_path / "w2")
    for name in ("config.json", "vocab.json", "sentencepiece.bpe.model"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    first, second = params_of(tmp_path / "w1"), params_of(tmp_path / "w2")
    assert first.keys() == second.keys()
    assert all(np.array_equal(first[k], second[k]) for k in first)
    if family == "nllb":
        theirs = json.loads((source / "tokenizer.json").read_text())
        ours = json.loads((tmp_path / "out" / "tokenizer.json").read_text())
        assert ours == theirs


@pytest.mark.slow  # a fast representative: the import-export-import test (the same writer, a converted workdir)
def test_our_model_exports_with_its_rows_in_fairseqs_order(tmp_path):
    """Our own multilingual model: the logits of M2M100ForConditionalGeneration on the permuted ids are ours,
    permuted; the specials, the pieces and the codes sit where fairseq's dictionary puts them."""
    workdir = make_workdir(tmp_path / "w", seed=1)
    report = m2m100_export.export_workdir(str(workdir), tmp_path / "out", choice=LAST)
    assert report["languages"] == ["ces_Latn", "deu_Latn", "eng_Latn", "fra_Latn"]
    assert "epsilon_logit_difference" not in report
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["bos_token_id"], hf["pad_token_id"], hf["eos_token_id"], hf["decoder_start_token_id"]) == (0, 1, 2, 0)
    tokens = json.loads((tmp_path / "out" / "tokenizer.json").read_text())
    codes = {t["content"]: t["id"] for t in tokens["added_tokens"] if t["id"] > 3}
    assert codes == {"ces_Latn": PIECES, "deu_Latn": PIECES + 1, "eng_Latn": PIECES + 2, "fra_Latn": PIECES + 3}

    config, model, _ = restore_model(str(workdir), LAST)
    order = m2m100_export.own_vocabulary(config, workdir_tokenizer(config, str(workdir))).order
    new_id = np.argsort(order)  # our id -> the exported one
    rng = np.random.default_rng(0)
    src = rng.integers(4, PIECES, size=(3, 9))
    src[:, 0] = PIECES + 2  # eng_Latn
    src[:, -1] = config.model.eos_id
    src[1, 4], src[1, 5:] = config.model.eos_id, config.model.pad_id
    tgt = rng.integers(4, PIECES, size=(3, 6))
    tgt[:, 0], tgt[:, 1] = config.model.bos_id, PIECES + 1  # <s> deu_Latn
    np.savez(tmp_path / "in.npz", src=new_id[src], tgt=new_id[tgt])
    run("logits", str(tmp_path / "out"), str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    theirs = np.load(tmp_path / "out.npz")["logits"]
    src_j, tgt_j = jnp.asarray(src, jnp.int32), jnp.asarray(tgt, jnp.int32)
    ours = np.asarray(model.decode(model.encode(src_j), tgt_j, src_tokens=src_j))[..., order]
    assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.slow  # the merges and vocabulary of transformers' own conversion of the same SentencePiece model
def test_the_bpe_model_is_transformers_conversion_of_ours(tmp_path):
    workdir = make_workdir(tmp_path / "w")
    m2m100_export.export_workdir(str(workdir), tmp_path / "out", choice=LAST)
    run("spm_to_bpe", str(workdir / "spm.model"), str(tmp_path / "bpe.json"))
    theirs = json.loads((tmp_path / "bpe.json").read_text())
    ours = json.loads((tmp_path / "out" / "tokenizer.json").read_text())["model"]
    assert ours["merges"] == theirs["merges"] and len(ours["merges"]) > 50
    assert set(ours["vocab"]) == set(theirs["vocab"])
    assert ours["byte_fallback"] is True


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"norm_position": "post"}, "model.norm_position='post'"),
        ({"norm": "rmsnorm"}, "model.norm='rmsnorm'"),
        ({"activation": "swiglu"}, "model.activation='swiglu'"),
        ({"num_kv_heads": 1}, "model.num_kv_heads=1"),
        ({"qk_head_dim": 3}, "model.qk_head_dim=3"),
        ({"positional": "learned"}, "model.positional='learned'"),
        ({"sinusoid_layout": "interleaved"}, "model.sinusoid_layout='interleaved'"),
        ({"position_offset": 0}, "model.position_offset=0"),
        ({"share_embeddings": False}, "model.share_embeddings=False"),
        ({"tie_output": False}, "model.tie_output=False"),
        ({"final_logits_bias": True}, "model.final_logits_bias=True"),
        ({"lang_token": "none"}, "model.lang_token='none'"),
        ({"lang_token": "source"}, "model.lang_token='source'"),
        ({"attention.window": 8}, "attention.window=8"),
        ({"data.tokenizer_type": "unigram"}, "data.tokenizer_type='unigram'"),
    ],
)
def test_what_m2m100_cannot_hold_is_refused_naming_the_key(overrides, key):
    config = schema.base_config("tiny")
    config.model.update(**EXPORTABLE, lang_token="target")
    config.data.update(tokenizer_type="bpe", directions=("en-de", "de-en"))
    for name, value in overrides.items():
        group, leaf = name.split(".") if "." in name else ("model", name)
        config[group][leaf] = value
    with pytest.raises(ConfigError, match="cannot export to M2M-100: " + re.escape(key)):
        m2m100_export.check_exportable(config)


@pytest.mark.parametrize("lang, message", [("zh", "more than one of the model's codes"), ("xx", "has no code")])
def test_a_language_nllb_cannot_name_is_refused(lang, message):
    config = schema.base_config("tiny")
    config.model.update(**EXPORTABLE, lang_token="target")
    config.data.update(tokenizer_type="bpe", directions=(f"en-{lang}",))
    with pytest.raises(ConfigError, match=f"data.directions language '{lang}': .*{message}"):
        m2m100_export.check_exportable(config)


@pytest.mark.slow  # a fast representative: the check_exportable tests above
def test_a_refused_export_is_one_line_and_writes_nothing(tmp_path):
    workdir = make_workdir(tmp_path / "w", lang_token="source", norm_position="post")
    done = export(workdir, tmp_path / "out")
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "model.norm_position='post'" in done.stderr and "model.lang_token='source'" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


@pytest.mark.slow  # folders.write_into_place's rules, tested with every format
def test_an_existing_output_is_replaced_only_with_force_and_only_if_it_is_an_export(tmp_path):
    workdir = make_workdir(tmp_path / "w")
    m2m100_export.export_workdir(str(workdir), tmp_path / "out", choice=LAST)
    with pytest.raises(EvalError, match="exists; choose another directory or pass --force"):
        m2m100_export.export_workdir(str(workdir), tmp_path / "out", choice=LAST)
    m2m100_export.export_workdir(str(workdir), tmp_path / "out", choice=LAST, force=True)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    with pytest.raises(EvalError, match="is not an M2M-100 export"):
        m2m100_export.export_workdir(str(workdir), workdir, choice=LAST, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "w"]


@pytest.mark.slow
def test_another_norm_epsilon_exports_with_one_warning_line_stating_the_difference(tmp_path):
    workdir = make_workdir(tmp_path / "w", norm_epsilon=1e-2)
    done = export(workdir, tmp_path / "out")
    assert done.returncode == 0, done.stderr[-2000:]
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "model.norm_epsilon=0.01" in warnings[0] and "M2M-100" in warnings[0], done.stderr
    assert float(warnings[0].split("differ by up to ")[1].split()[0]) > 1e-4


@pytest.mark.slow  # the ids on real text: the trained model's test; this one, the source layout with codes
def test_autotokenizer_gives_the_source_code_our_ids_and_eos(tmp_path):
    workdir = make_workdir(tmp_path / "w")
    m2m100_export.export_workdir(str(workdir), tmp_path / "out", choice=LAST)
    config, _, _ = restore_model(str(workdir), LAST)
    tokenizer = workdir_tokenizer(config, str(workdir))
    new_id = np.argsort(m2m100_export.own_vocabulary(config, tokenizer).order)
    (tmp_path / "s.json").write_text(json.dumps(SENTENCES))
    run("tokenize", str(tmp_path / "out"), str(tmp_path / "s.json"), str(tmp_path / "ids.json"), "fra_Latn")
    theirs = json.loads((tmp_path / "ids.json").read_text())
    assert theirs == [[PIECES + 3, *new_id[tokenizer.encode_source(s)].tolist(), 2] for s in SENTENCES]


MULTI30K = DATA / "multi30k"


@pytest.mark.slow
@pytest.mark.skipif(not (MULTI30K / "train.cs").is_file(), reason="needs the shared 4-way Multi30k copy")
def test_an_exported_trained_model_tokenizes_and_translates_in_transformers_as_evaluate_does(tmp_path):
    """A tiny lang_token=target model of ours trained 400 steps on Multi30k's en-centric directions, exported:
    its tokenizer.json gives our ids (permuted, `X </s>`) and our text back on every test line of the four
    languages, and AutoTokenizer (NllbTokenizer) on every line our tokenizer spells without bytes and that does not
    start with a space (docs/pretrained.md); generate(num_beams=1, forced_bos_token_id=deu_Latn) on sources
    without a code, decoded by tokenizer.json, equals evaluate.py --target_lang de's greedy text."""
    workdir, steps = tmp_path / "w", 400
    trained = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/multilingual.py:size=tiny,directions=en-centric"]
        + ["--workdir", str(workdir), f"--config.train.num_steps={steps}", f"--config.ckpt.every_steps={steps}"]
        + ["--config.opt.warmup_steps=100", "--config.train.eval_every=0", "--config.train.bleu_every=0"]
        + [f"--config.model.{key}={value}" for key, value in EXPORTABLE.items()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=1200,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert export(workdir, tmp_path / "out").returncode == 0

    lines = [line for lang in LANGS for line in (MULTI30K / f"test.{lang}").read_text(encoding="utf-8").splitlines()]
    lines += ["  two spaces first", "Zürich 42 € 日本"]
    (tmp_path / "lines.json").write_text(json.dumps(lines))
    run("tokenize_plain", str(tmp_path / "out"), str(tmp_path / "lines.json"), str(tmp_path / "ids.json"))
    theirs = json.loads((tmp_path / "ids.json").read_text())
    config, _, _ = restore_model(str(workdir), LAST)
    tokenizer = workdir_tokenizer(config, str(workdir))
    new_id = np.argsort(m2m100_export.own_vocabulary(config, tokenizer).order)
    ours = [new_id[tokenizer.encode_source(line)].tolist() for line in lines]
    assert theirs["file"] == [ids + [2] for ids in ours]
    assert theirs["decoded"] == [tokenizer.decode_target(tokenizer.encode_source(line)) for line in lines]
    spelled = [
        not line.startswith(" ") and not any(p.startswith("<0x") for p in tokenizer.source_pieces(ids))
        for line, ids in zip(lines, map(tokenizer.encode_source, lines), strict=True)
    ]
    assert [i for i, ok in enumerate(spelled) if ok and theirs["auto"][i] != ours[i]] == []
    assert sum(spelled) > 0.9 * len(lines)

    source = tmp_path / "src.en"
    source.write_text("".join(MULTI30K.joinpath("test.en").read_text(encoding="utf-8").splitlines(True)[:60]))
    evaluated = subprocess.run(
        [sys.executable, "evaluate.py", "--workdir", str(workdir), "--average_last", "1", "--beam_size", "1"]
        + ["--max_extra_len", "10", "--source_file", str(source), "--target_lang", "de"]
        + ["--output_file", str(tmp_path / "ours.de")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    run(
        "translate_plain",
        str(tmp_path / "out"),
        str(source),
        str(tmp_path / "theirs.de"),
        "10",
        "deu_Latn",
        timeout=900,
    )
    mine = (tmp_path / "ours.de").read_text(encoding="utf-8").splitlines()
    theirs = (tmp_path / "theirs.de").read_text(encoding="utf-8").splitlines()
    assert len(mine) == len(theirs) == 60 and len(set(mine)) > 20  # outputs that differ from line to line
    assert [i for i in range(60) if mine[i] != theirs[i]] == []
