"""transformer_jax.visualize and its command line, transformer_jax.visualize: the arrays drawn are the model's
(checked against a recomputation), the PNGs are valid and of the stated size, and bad arguments fail with messages
that name them."""

from __future__ import annotations

import json
import pathlib
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from matplotlib import colormaps
from matplotlib.image import imread

from tests.helpers import REPO
from tests.helpers.training import tiny_train_config, write_corpus
from transformer_jax import visualize as viz
from transformer_jax.data.tokenizer import get_tokenizer
from transformer_jax.errors import VisualizeError
from transformer_jax.model.layers import SpecialIds
from transformer_jax.training.checkpoints import Checkpointer
from transformer_jax.training.step import create_train_state, eval_model, learning_rate_schedule
from transformer_jax.visualize import __main__ as visualize
from transformer_jax.visualize.attention import (
    ATTENTION_KINDS,
    AttentionMaps,
    attention_figsize,
    attention_weights,
    encode_pair,
    plot_attention,
)
from transformer_jax.visualize.figures import DPI, FIGSIZE, curves_figsize

SOURCE, TARGET = "the big dog runs in the park", "der große hund läuft"


def png_size(path: pathlib.Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the PNG signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def pixels(figsize: tuple[float, float]) -> tuple[int, int]:
    return round(figsize[0] * DPI), round(figsize[1] * DPI)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A workdir with a tokenizer and checkpoints at steps 1 and 2 (different parameters), saved directly."""
    corpus = write_corpus(tmp_path_factory.mktemp("corpus"), n_train=200, n_valid=4)
    workdir = tmp_path_factory.mktemp("workdir")
    config = tiny_train_config(corpus)
    config.model.num_encoder_layers = config.model.num_decoder_layers = 2  # pictures of several layers
    get_tokenizer(config.data, workdir, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config))
    graphs, state = create_train_state(config)
    # Step 2: every float array scaled, so its attention weights differ from step 1's.
    scaled = jax.tree.map(lambda x: x * 1.5 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    checkpointer = Checkpointer(workdir, config.ckpt)
    checkpointer.save(1, state, {}, config)
    checkpointer.save(2, scaled, {}, config)
    checkpointer.close()
    models = {1: eval_model(graphs, state), 2: eval_model(graphs, scaled)}  # references
    return workdir, config, models


def tokenizer_of(run):
    workdir, config, _ = run
    return get_tokenizer(config.data, workdir, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config))


@pytest.fixture(scope="module")
def drawn(run, tmp_path_factory):
    workdir, _, _ = run
    return viz.attention(workdir, SOURCE, TARGET, tmp_path_factory.mktemp("attention"), checkpoint=1)


def test_attention_weights_are_the_ones_the_model_computes(run, drawn):
    _, _, models = run
    model, maps = models[1], drawn.maps
    assert drawn.step == 1
    assert maps.src_pieces[-1] == "</s>" and maps.tgt_pieces[0] == "<s>"
    assert "".join(maps.src_pieces[:-1]).replace("▁", " ").strip() == SOURCE
    S, T, N = len(maps.src_pieces), len(maps.tgt_pieces), model.spec.num_heads
    # Encoder layer 0 by hand: softmax(Q K^T / sqrt(d_k)) from the layer's own projections of the embeddings.
    src_ids, _ = encode_pair(tokenizer_of(run), SOURCE, TARGET)
    src = jnp.asarray([src_ids], jnp.int32)
    layer = model.encoder_layers[0].self_attn
    x = model._embed(src, jnp.arange(S)[None], target=False)
    q = layer.q_proj(x).reshape(1, S, N, -1)
    k, _ = layer.project_kv(x)
    expected = jax.nn.softmax(jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]), axis=-1)[0]
    np.testing.assert_allclose(maps.weights["encoder"][0], expected, rtol=1e-5, atol=1e-6)
    shapes = {"encoder": (N, S, S), "decoder": (N, T, T), "cross": (N, T, S)}
    for kind, layers in maps.weights.items():
        assert len(layers) == 2
        for w in layers:
            assert w.shape == shapes[kind]
            np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
            if kind == "decoder":
                np.testing.assert_array_equal(np.triu(w, 1), 0.0)  # no query sees a later token


def test_attention_figures_one_per_kind_and_layer_at_the_stated_size(drawn):
    maps = drawn.maps
    assert len(drawn.paths) == 6  # 3 kinds x 2 layers
    for kind in ATTENTION_KINDS:
        for i, w in enumerate(maps.weights[kind]):
            path = next(p for p in drawn.paths if p.name == f"attention_{kind}_layer{i}.png")
            assert png_size(path) == pixels(attention_figsize(w.shape[0], w.shape[1], w.shape[2]))


def test_attention_pixels_show_the_weights_in_place(tmp_path):
    """Reads the PNG back and finds each cell's weight in its colour: the diagonal bright, the rest dark, and the one
    half-weight cell at the top right (query 0, last key), so rows are queries from the top and columns keys."""
    T, S = 4, 6
    w_TS = np.eye(T, S, dtype=np.float32)
    w_TS[0, S - 1] = 0.5
    maps = AttentionMaps([f"s{j}" for j in range(S)], [f"t{i}" for i in range(T)], {})
    maps.weights = {"encoder": [w_TS[None]], "decoder": [w_TS[None]], "cross": [w_TS[None]]}
    path = tmp_path / "attention_cross_layer0.png"
    assert path in plot_attention(maps, tmp_path)
    rgb = imread(path)[..., :3]
    assert rgb.shape[1::-1] == pixels(attention_figsize(1, T, S))
    # The panel: the widest run of columns holding the colour of weight 0 (the colour bar is a narrow strip).
    lut = colormaps["viridis"](np.linspace(0.0, 1.0, 256))[:, :3]
    dark = np.abs(rgb - lut[0]).max(-1) < 0.02
    columns = np.flatnonzero(dark.any(0))
    runs = np.split(columns, np.flatnonzero(np.diff(columns) > 1) + 1)
    x = max(runs, key=len)
    y = np.flatnonzero(dark[:, x].any(1))
    x0, x1, y0, y1 = x[0], x[-1] + 1, y[0], y[-1] + 1
    assert (x1 - x0) / (y1 - y0) == pytest.approx(S / T, rel=0.05)  # square cells
    centres_y = y0 + (np.arange(T) + 0.5) * (y1 - y0) / T
    centres_x = x0 + (np.arange(S) + 0.5) * (x1 - x0) / S
    cells = rgb[centres_y.astype(int)[:, None], centres_x.astype(int)[None, :]]  # [T, S, 3]
    shown = np.abs(cells[:, :, None, :] - lut).sum(-1).argmin(-1) / 255  # nearest colour of the map -> weight
    np.testing.assert_allclose(shown, w_TS, atol=1 / 255)


def test_one_head_of_one_layer_and_checkpoint_choice(run, tmp_path):
    workdir, _, models = run
    result = viz.attention(workdir, SOURCE, TARGET, tmp_path, layer=1, head=3)  # latest = step 2
    assert result.step == 2
    assert [p.name for p in result.paths] == [
        f"attention_{k}_layer1_head3.png" for k in ("encoder", "decoder", "cross")
    ]
    cross = result.drawn[result.paths[2]]
    np.testing.assert_array_equal(cross, result.maps.weights["cross"][1][3:4])
    assert png_size(result.paths[2]) == pixels(attention_figsize(1, *cross.shape[1:]))
    # Step 2's parameters differ from step 1's, and the weights follow them.
    src_ids, tgt_ids = encode_pair(tokenizer_of(run), SOURCE, TARGET)
    expected = attention_weights(models[2], src_ids, tgt_ids)["cross"][1]
    np.testing.assert_allclose(result.maps.weights["cross"][1], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(source=" "), "--source is empty"),
        (dict(target=""), "--target is empty"),
        (dict(checkpoint=5), r"no checkpoint for step 5 .*available steps: \[1, 2\]"),
    ],
)
def test_attention_bad_arguments(run, tmp_path, kwargs, message):
    args = {"source": SOURCE, "target": TARGET, **kwargs}
    with pytest.raises(VisualizeError, match=message):
        viz.attention(run[0], args.pop("source"), args.pop("target"), tmp_path, **args)


def test_unknown_layer_or_head_names_the_valid_range(drawn, tmp_path):
    with pytest.raises(VisualizeError, match=r"--layer 7: .* in 0\.\.1"):
        plot_attention(drawn.maps, tmp_path, layer=7)
    with pytest.raises(VisualizeError, match=r"--head -1: .* in 0\.\.3"):
        plot_attention(drawn.maps, tmp_path, head=-1)


def test_attention_needs_a_workdir_with_checkpoints(tmp_path):
    with pytest.raises(VisualizeError, match="no such directory"):
        viz.attention(tmp_path / "missing", SOURCE, TARGET, tmp_path)
    with pytest.raises(VisualizeError, match=r"no checkpoint in \S*checkpoints"):
        viz.attention(tmp_path, SOURCE, TARGET, tmp_path)


def test_positional_dot_products_depend_on_the_offset_only(tmp_path):
    d_model, max_len = 64, 80
    result = viz.positional(d_model, max_len, tmp_path, positions=[0, 7, 20, 45])
    assert result.pe_PD.shape == (max_len, d_model)
    np.testing.assert_allclose(result.pe_PD[3, 0::2], np.sin(3 / 10000 ** (np.arange(0, d_model, 2) / d_model)), 1e-5)
    assert len(result.offsets) == max_len - 45
    closed_form = np.cos(np.outer(result.offsets, 1 / 10000 ** (np.arange(0, d_model, 2) / d_model))).sum(-1)
    for pos, dots in result.dots.items():
        np.testing.assert_allclose(dots, result.dots[0], atol=1e-3, err_msg=f"pos {pos}")
        np.testing.assert_allclose(dots, closed_form, atol=1e-3, err_msg=f"pos {pos}")
    assert [png_size(p) for p in result.paths] == [pixels(FIGSIZE), pixels(FIGSIZE)]
    with pytest.raises(VisualizeError, match="--d_model must be even"):
        viz.positional(63, max_len, tmp_path)
    with pytest.raises(VisualizeError, match=r"--positions must be in 0\.\.78"):
        viz.positional(d_model, max_len, tmp_path, positions=[79])


def test_schedule_is_the_configs_warmup_then_inverse_sqrt(run, tmp_path, monkeypatch):
    config = run[1]
    result = viz.schedule(config, tmp_path, num_steps=40)
    assert png_size(result.path) == pixels(FIGSIZE)
    expected = learning_rate_schedule(config.opt, 40)(jnp.arange(40))
    np.testing.assert_allclose(result.learning_rates, expected, rtol=1e-6)
    warmup = config.opt.warmup_steps
    assert result.steps[np.argmax(result.learning_rates)] == warmup
    after = result.learning_rates[warmup - 1 :]  # update number s >= warmup: learning_rate * s^-0.5
    np.testing.assert_allclose(after, config.opt.learning_rate * result.steps[warmup - 1 :] ** -0.5, rtol=1e-5)
    # The CLI reads a config file as train.py does, overrides included.
    drawn = []
    monkeypatch.setattr(visualize, "schedule", lambda *args: drawn.append(viz.schedule(*args)) or drawn[-1])
    argv = ["schedule", "--config", f"{REPO}/configs/wmt14_ende.py:size=tiny", "--config.opt.warmup_steps=7"]
    assert visualize.main([*argv, "--num_steps", "20", "--output_dir", str(tmp_path / "cli")]) == 0
    assert drawn[0].steps[np.argmax(drawn[0].learning_rates)] == 7 and len(drawn[0].steps) == 20


def write_metrics(directory: pathlib.Path, records: list[dict]) -> pathlib.Path:
    directory.mkdir(parents=True)
    path = directory / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_curves_one_line_per_run_labelled_by_directory(tmp_path):
    a = write_metrics(
        tmp_path / "run_a", [{"step": s, "loss": 5 - s / 10} for s in (1, 2, 3)] + [{"step": 3, "valid_loss": 4.0}]
    )
    b = write_metrics(
        tmp_path / "run_b", [{"step": s, "loss": 6 - s / 10} for s in (1, 2)] + [{"step": 2, "loss": 1.0}]
    )
    result = viz.curves([a, tmp_path / "run_b"], tmp_path / "out", keys=["loss", "valid_loss"])
    assert png_size(result.path) == pixels(curves_figsize(2))
    assert set(result.data["loss"]) == {"run_a", "run_b"}
    np.testing.assert_array_equal(result.data["loss"]["run_a"][0], [1, 2, 3])
    np.testing.assert_allclose(result.data["loss"]["run_b"][1], [5.9, 1.0])  # a step logged twice: the last wins
    assert set(result.data["valid_loss"]) == {"run_a"}
    assert viz.curves([b], tmp_path / "out2").keys == ["loss"]  # default: the known keys present
    with pytest.raises(VisualizeError, match=r"--keys: unknown metrics key\(s\) \['bleu'\].*available"):
        viz.curves([a], tmp_path, keys=["bleu"])
    with pytest.raises(VisualizeError, match="--metrics: no such file .*missing"):
        viz.curves([a, tmp_path / "missing" / "metrics.jsonl"], tmp_path)


def test_cli_prints_paths_and_reports_errors_without_traceback(run, tmp_path, capsys):
    assert visualize.main(["positional", "--d_model", "16", "--max_len", "20", "--output_dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "positional_encoding.png"),
        str(tmp_path / "positional_dot_products.png"),
    ]
    # `--metrics A B`: the files after the flag are more runs.
    a = write_metrics(tmp_path / "a", [{"step": 1, "loss": 2.0}])
    b = write_metrics(tmp_path / "b", [{"step": 1, "loss": 3.0}])
    assert visualize.main(["curves", "--metrics", str(a), str(b), "--output_dir", str(tmp_path / "c")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "c" / "curves.png")]
    cases = [
        (["curves", "--metrics", str(tmp_path / "none.jsonl")], "curves: error: --metrics: no such file"),
        (["attention", "--workdir", str(run[0]), "--source", "a", "--target", "b", "--layer", "7"], "0..1"),
        (["attention", "--workdir", str(tmp_path), "--source", "a", "--target", "b"], "no checkpoint"),
        (["schedule", "--config", "missing.py"], "--config missing.py: no such file"),
        (["schedule", "--config", "missing.py", "--config.opt.warmup_steps=3"], "--config missing.py: no such file"),
        (["attention", "--workdir", str(tmp_path), "--source", "a"], "required: --target"),
        (["positional", "--layer", "1"], "--layer: not a flag of the positional command"),
        (["positional", "--d_model", "sixteen"], "--d_model"),
        (["positional", "extra"], "unexpected arguments: ['extra']"),
        (["pictures"], "unknown command 'pictures'; the first argument is one of attention, positional"),
        ([], "no command"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            visualize.main([*argv, "--output_dir", str(tmp_path)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
