"""python -m transformer_jax.explain and transformer_jax.explain: the page's translation is evaluate.py's, every
intermediate it shows is the model's own tensor (recomputed here from the model's public pieces), its checks are
measured, it renders in a real browser, and bad input is one clear line."""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from matplotlib.image import imread

from tests.helpers.training import tiny_train_config, write_corpus
from transformer_jax.data.tokenizer import get_tokenizer
from transformer_jax.evaluation.command import evaluate
from transformer_jax.evaluation.translate import source_ids
from transformer_jax.explain import __main__ as explain_cli
from transformer_jax.explain.capture import explain
from transformer_jax.explain.page import figures, fmt, header, position_check, render, rotation, summary
from transformer_jax.explain.text import TEXT
from transformer_jax.model.layers import SpecialIds, sinusoidal_encoding
from transformer_jax.model.transformer import capture_attention_weights
from transformer_jax.training.checkpoints import Checkpointer
from transformer_jax.training.step import create_train_state, eval_model
from transformer_jax.visualize.figures import sinusoid_table

SENTENCE = "the big dog runs in the park"
DEVANAGARI = re.compile("[\u0900-\u097f]")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A workdir with a tokenizer and one checkpoint of an untrained 1+1-layer model, and that model."""
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"), n_train=200, n_valid=4)
    workdir = tmp_path_factory.mktemp("workdir")
    config = tiny_train_config(corpus)
    config.eval.average_last = 1  # one checkpoint
    config.eval.max_extra_len = 4  # an untrained model rarely emits </s>: keep its outputs short
    config.eval.beam_size = 3
    get_tokenizer(config.data, workdir, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config))
    graphs, state = create_train_state(config)
    checkpointer = Checkpointer(workdir, config.ckpt)
    checkpointer.save(1, state, {}, config)
    checkpointer.close()
    return workdir, config, eval_model(graphs, state)


@pytest.fixture(scope="module")
def beam(run):
    """The explanation of SENTENCE with the saved config's decoding settings (beam size 3)."""
    workdir, _, _ = run
    return explain(str(workdir), SENTENCE)


@pytest.fixture(scope="module")
def pages(beam):
    """The figures and the English page, rendered once (matplotlib's images are most of the page's cost)."""
    f = figures(beam)
    return f, render(beam, f, "en")


def evaluate_py(workdir: Path, sentence: str, beam_size: int | None, tmp_path: Path) -> str:
    """evaluate.py's translation of one sentence (its package entry point, with the real checkpoint reader)."""
    source, output = tmp_path / f"src{beam_size}.txt", tmp_path / f"out{beam_size}.txt"
    source.write_text(sentence + "\n", encoding="utf-8")
    evaluate(dict(workdir=str(workdir), source_file=str(source), output_file=str(output), beam_size=beam_size))
    return output.read_text(encoding="utf-8").rstrip("\n")


@pytest.mark.slow  # the fast representative: the beam test below (same path, another search function)
def test_greedy_translation_and_teacher_forced_target_are_evaluates(run, tmp_path):
    workdir, _, _ = run
    greedy = explain(str(workdir), SENTENCE, beam_size=1)
    assert greedy.translation == evaluate_py(workdir, SENTENCE, 1, tmp_path)
    # The decoder is fed that same translation: its pieces are the last search step's best hypothesis.
    best = greedy.beam_steps[-1][0]
    assert [p for p in best.pieces if p != "</s>"] == greedy.tgt_in_pieces[1:]
    assert all(len(beams) == 1 for beams in greedy.beam_steps)  # greedy: one hypothesis a step
    assert [len(b[0].pieces) for b in greedy.beam_steps] == list(range(1, len(greedy.beam_steps) + 1))


def test_beam_translation_is_evaluates_and_its_steps_extend_each_other(run, beam, tmp_path):
    workdir, _, _ = run
    x = beam
    assert x.translation == evaluate_py(workdir, SENTENCE, None, tmp_path)  # the saved config's beam size, 3
    assert x.settings["beam_size"] == 3
    best = x.beam_steps[-1][0]
    assert [p for p in best.pieces if p != "</s>"] == x.tgt_in_pieces[1:]
    steps = x.beam_steps
    assert len(steps[0]) <= 3 and all(1 <= len(beams) <= 3 for beams in steps)
    for before, after in zip(steps, steps[1:], strict=False):
        for hyp in after:  # every hypothesis extends one of the step before (or is one that had ended)
            assert any(hyp.pieces[: len(b.pieces)] == b.pieces for b in before)
        assert [h.score for h in after] == sorted((h.score for h in after), reverse=True)


def test_every_intermediate_is_the_models_own_tensor(run, beam):
    _, _, model = run
    x = beam
    src = jnp.asarray([x.src_ids], jnp.int32)
    tgt_in = jnp.asarray([x.tgt_in_ids], jnp.int32)
    S, d = src.shape[1], model.spec.d_model

    def close(a, b, atol=1e-5):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=atol)

    # Embedding × √d_model, + PE: from the embedding table and the model's sinusoidal_encoding.
    scaled = model.src_embed.table_VD[...][src[0]] * np.sqrt(d)
    close(x.sown["src_scaled_embedding"], scaled)
    pe = sinusoidal_encoding(jnp.arange(S)[None], d, model.spec.sinusoid_layout)[0]
    close(x.sown["src_embedding_plus_positions"], scaled + pe)
    # Q, K, V of encoder layer 0: its projections of the embedded input (post-LN: the layer's input).
    attn = model.encoder_layers[0].self_attn
    h0 = jnp.asarray(x.sown["src_embedding_plus_positions"])[None]
    close(x.attention("encoder_layers", "self_attn", "q"), attn.q_proj(h0).reshape(1, S, attn.num_heads, -1)[0])
    k, v = attn.project_kv(h0)
    close(x.attention("encoder_layers", "self_attn", "k"), k[0])
    close(x.attention("encoder_layers", "self_attn", "v"), v[0])
    # Attention weights: captured independently through the existing capture_attention_weights path.
    capture_attention_weights(model)
    try:
        logits, weights = nnx.capture(model, nnx.Intermediate)(src, tgt_in)
        weights = nnx.to_pure_dict(weights)
    finally:
        capture_attention_weights(model, False)
    for stack in ("encoder_layers", "decoder_layers"):
        for module in ("self_attn", "cross_attn") if stack == "decoder_layers" else ("self_attn",):
            close(x.attention(stack, module, "attention_weights"), weights[stack][0][module]["attention_weights"][0][0])
    # The attention output, the residual + norm, the FFN's ReLU, the encoder output and the logits.
    out = attn(h0, (k, v), q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None, causal=False)
    close(x.attention("encoder_layers", "self_attn", "output"), out[0])
    residual = model.encoder_layers[0].self_attn_residual
    close(x.sown["encoder_layers"][0]["self_attn_residual"]["norm_input"], (h0 + out)[0])
    normed = residual.norm(h0 + out)
    close(x.sown["encoder_layers"][0]["self_attn_residual"]["norm_output"], normed[0])
    close(x.sown["encoder_layers"][0]["ffn"]["hidden"], jax.nn.relu(model.encoder_layers[0].ffn.w1(normed))[0])
    close(x.logits_TV, logits[0], atol=1e-4)
    # The capture points are off again, so the next forward pass sows nothing.
    model(src, tgt_in)
    assert not jax.tree.leaves(nnx.to_pure_dict(nnx.state(model, nnx.Intermediate)))


def test_figures_are_measured_and_the_page_shows_them(beam, pages):
    x = beam
    f, page = pages
    h = f.encoder
    q, k = x.attention("encoder_layers", "self_attn", "q")[:, 0], x.attention("encoder_layers", "self_attn", "k")[:, 0]
    scores = q.astype(np.float64) @ k.astype(np.float64).T
    assert h.var_scores == pytest.approx(scores.var(), rel=1e-6)
    assert h.var_scaled * x.spec.d_qk == pytest.approx(h.var_scores, rel=1e-9)  # the 1/√d_k scaling, measured
    assert h.softmax_error < 1e-5 and h.weighted_v_error < 1e-5
    # The causal mask: i sees j exactly when j <= i, and the model's weights vanish elsewhere.
    T = len(x.tgt_in_ids)
    np.testing.assert_array_equal(f.mask_TT, np.tril(np.ones((T, T), bool)))
    assert f.above_diagonal == 0.0
    hidden = x.sown["encoder_layers"][0]["ffn"]["hidden"]
    assert f.zeros[0] == pytest.approx(np.mean(hidden == 0)) and 0 < f.zeros[0] < 1
    # Top-5 per step: the decoder's softmax, most probable first.
    assert len(f.steps) == T and f.steps[-1].expected == "</s>"
    probs = jax.nn.softmax(x.logits_TV[0])
    assert f.steps[0].top[0][1] == pytest.approx(float(probs.max()), rel=1e-5)
    for shown in (x.translation, fmt(h.var_scores), fmt(h.var_scaled), fmt(f.zeros[0]), "j ≤ i", "</s>"):
        assert shown.replace("<", "&lt;").replace(">", "&gt;") in page
    assert "sentence:" in summary(x, f)


def test_pe_check_is_computed_and_fails_for_a_wrong_rotation():
    check = position_check(12, 32)
    assert check.pairs == 66 and check.max_error < 1e-5
    pe = sinusoid_table(12, 32).astype(np.float64)
    m3 = rotation(pe[3])
    np.testing.assert_allclose(m3 @ m3.T, np.eye(32), atol=1e-6)  # a rotation
    np.testing.assert_allclose(rotation(pe[1]) @ rotation(pe[2]), m3, atol=1e-5)  # M_1 M_2 = M_3
    assert np.abs(pe[5] - rotation(pe[2]) @ pe[1]).max() > 0.1  # M_2 takes pos 1 to 3, not 5


def test_every_string_has_a_hindi_version(beam):
    assert TEXT["hi"].keys() == TEXT["en"].keys()
    for key, text in TEXT["hi"].items():
        assert DEVANAGARI.search(text) or key == "log_prob", key  # "log P" is a formula
        assert re.findall(r"\{\w+\}", text) == re.findall(r"\{\w+\}", TEXT["en"][key]), key  # the same figures
    hi = "".join(header(beam, TEXT["hi"]))
    assert DEVANAGARI.search(hi) and beam.translation in hi


@pytest.mark.slow  # renders the whole page twice more
def test_hindi_page_has_the_same_numbers_and_images(beam, pages):
    f, en = pages
    hi = render(beam, f, "hi")
    assert DEVANAGARI.search(hi) and not DEVANAGARI.search(en)
    number = re.compile(r"\d+\.\d+(?:e[-+]\d+)?")
    assert number.findall(re.sub(r"<[^>]*>", " ", en)) == number.findall(re.sub(r"<[^>]*>", " ", hi))
    assert 'lang="hi"' in hi and hi.count("<img alt=") == en.count("<img alt=") == 6


def test_long_sentence_is_cut_as_evaluate_cuts_it_and_the_page_says_so(run, beam):
    workdir, config, _ = run
    tokenizer = get_tokenizer(config.data, workdir, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config))
    limit = config.data.eval_max_len
    long = " ".join([SENTENCE] * 10)
    ids, cut = source_ids(tokenizer, long, limit)  # evaluation.translate's rule, which capture uses
    full = tokenizer.encode_source(long)
    assert ids == full[: limit - 1] + [SpecialIds.DEFAULT.eos] and cut
    assert source_ids(tokenizer, SENTENCE, limit)[1] is False
    truncated = (len(full) + 1, limit)
    assert f"cut to {limit} tokens" in "".join(header(dataclasses.replace(beam, truncated=truncated), TEXT["en"]))
    assert f"cut to {limit} tokens" not in "".join(header(beam, TEXT["en"]))


@pytest.mark.slow
def test_long_sentence_and_given_target_end_to_end(run, tmp_path, capsys):
    workdir, config, _ = run
    output = tmp_path / "pages" / "long.html"
    long = " ".join([SENTENCE] * 10)
    explain_cli.main(["--workdir", str(workdir), long, "--target", "der hund", "--output", str(output), "--head", "1"])
    limit = config.data.eval_max_len
    page = output.read_text(encoding="utf-8")
    assert f"cut to {limit} tokens" in page and TEXT["en"]["target_given"] in page
    assert "&lt;s&gt;</td><td>▁der</td>" in page  # the first target step: fed <s>, next ▁der
    out = capsys.readouterr().out
    assert f"to {limit} tokens" in out and f"wrote {output}" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workdir", "{workdir}", "   "], "the sentence is empty"),
        (["--workdir", "{workdir}"], "no sentence; give exactly one sentence"),
        (["--workdir", "{empty}", "a dog"], "no checkpoint in"),
        (["--workdir", "{missing}", "a dog"], "no such directory"),
        (["--workdir", "{workdir}", "a dog", "--layer", "5"], "--layer 5: the model has 1 encoder and 1 decoder"),
        (["--workdir", "{workdir}", "a dog", "--output", "{workdir}/page.png"], "give a file name ending in .html"),
    ],
)
def test_bad_input_is_one_clear_line(run, tmp_path, capsys, args, message):
    workdir, _, _ = run
    (tmp_path / "empty").mkdir()
    names = {"workdir": workdir, "empty": tmp_path / "empty", "missing": tmp_path / "missing"}
    with pytest.raises(SystemExit) as exit_info:
        explain_cli.main([a.format(**names) for a in args])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err, err


def chromium() -> str | None:
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


@pytest.mark.slow
def test_page_renders_in_headless_chromium_without_console_errors(pages, tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("headless Chromium not found (install the system package: apt-get install chromium)")
    html = pages[1]
    rgb, console = screenshot(browser, html, tmp_path / "page")
    assert not console, console
    assert rgb.shape[:2] == (3000, 1200)
    assert rgb.std() > 0.05 and (rgb < 0.5).mean() > 0.01  # text and images, not a blank page
    assert all(re.search(r'alt="[^"]+"', tag) for tag in re.findall(r"<img[^>]*>", html))
    # The console check can fail: the same page with a script that throws.
    _, console = screenshot(browser, html.replace("</body>", "<script>notDefined();</script></body>"), tmp_path / "bad")
    assert any("notDefined" in line for line in console)


def screenshot(browser: str, html: str, folder: Path) -> tuple[np.ndarray, list[str]]:
    """(RGB pixels of a 1200x3000 headless screenshot of the page, the browser's console error lines)."""
    folder.mkdir()
    page, shot = folder / "explain.html", folder / "shot.png"
    page.write_text(html, encoding="utf-8")
    result = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
         f"--screenshot={shot}", "--window-size=1200,3000", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shot.exists(), result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    return imread(shot)[..., :3], console
