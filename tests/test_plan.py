"""train.py --plan: the real train step compiled for a TPU slice on this CPU host (needs requirements-aot.txt).

Compiles of tiny configs take seconds; the GPU plan and the full batch search are slow-marked.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys

import pytest

from configs import common
from tests.helpers import REPO
from transformer_jax.plan import accelerators
from transformer_jax.plan import report as plan
from transformer_jax.plan.accelerators import parse_topology
from transformer_jax.sharding import make_mesh

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="needs libtpu: pip install -r requirements-aot.txt"
)
# XLA's FLOPs count softmax, norms and elementwise ops that training/metrics.py leaves out: a few percent at
# d_model = 256, more for narrower models.
FLOPS_TOLERANCE = 0.1


def small_config(d_model: int = 256, batch_size: int = 16, **model):
    config = common.base_config("tiny")
    config.model.vocab_size = 320
    config.model.num_encoder_layers = config.model.num_decoder_layers = 1
    config.model.d_model, config.model.d_ff = d_model, 4 * d_model
    config.model.update(model)
    config.model.dtype = "bfloat16"
    config.data.batching = "pack"
    config.data.batch_size = batch_size
    config.data.max_len = 32
    return config


def cli_args(config) -> list[str]:
    """--config.KEY=VALUE overrides that turn configs/wmt14_ende.py:size=tiny into `config`."""
    keys = {
        "model": ("vocab_size", "num_encoder_layers", "num_decoder_layers", "d_model", "d_ff", "dtype"),
        "data": ("batching", "batch_size", "max_len"),
    }
    flags = [f"--config.{group}.{key}={config[group][key]}" for group, names in keys.items() for key in names]
    return [sys.executable, str(REPO / "train.py"), "--config", "configs/wmt14_ende.py:size=tiny", *flags]


@pytest.fixture(scope="module")
def both_meshes():
    return plan.search_mesh(small_config(), parse_topology("v5e:2x2"))


@pytest.mark.parametrize("mode", ["data", "fsdp"])
def test_the_plan_of_each_mesh_is_consistent(both_meshes, mode):
    report = both_meshes["meshes"][mode]
    shards = 1 if mode == "data" else 4
    memory, per_chip = report["memory_analysis_per_chip"], report["per_chip_bytes"]
    assert report["topology"]["device_kind"] == "TPU v5 lite" and report["topology"]["chips"] == 4
    assert report["step"]["batch_rows_src_tgt"] == [16, 32, 32]
    # The arguments hold the state and the batch: at least a chip's shards of parameters and optimizer state.
    assert memory["argument"] >= per_chip["parameters"] + per_chip["optimizer_state"] + per_chip["batch"]
    assert per_chip["parameters"] * shards >= both_meshes["meshes"]["data"]["per_chip_bytes"]["parameters"] * 0.95
    assert memory["alias"] > 0.9 * (per_chip["parameters"] + per_chip["optimizer_state"])  # the state is donated
    assert memory["temp"] > 0 and report["fits"] and report["headroom_bytes"] > 0
    estimate = report["estimate"]
    assert estimate["step_s"] >= max(estimate["compute_s"], estimate["hbm_s"]) > 0
    assert 0 < estimate["mfu"] <= 1
    assert estimate["hours"] == pytest.approx(estimate["step_s"] * estimate["num_steps"] / 3600)


def test_fsdp_gathers_parameters_and_data_parallel_reduces_gradients(both_meshes):
    data, fsdp = (both_meshes["meshes"][mode]["collectives_per_step"] for mode in ("data", "fsdp"))
    assert data["all-reduce"]["count"] > 0 and data["all-gather"]["count"] == 0
    assert fsdp["all-gather"]["count"] > 0 or fsdp["reduce-scatter"]["count"] > 0
    assert both_meshes["chosen"] in ("data", "fsdp")


def test_compiled_flops_agree_with_the_formula(both_meshes):
    for planned in both_meshes["meshes"].values():
        assert planned["flops_per_step"]["compiled_over_formula"] == pytest.approx(1.0, abs=FLOPS_TOLERANCE)


def test_a_batch_that_cannot_fit_is_one_line_and_a_nonzero_exit():
    # 2^20 rows of 256 tokens: the TPU compiler itself refuses (a terabyte of temporaries), in seconds.
    config = small_config(d_model=32, batch_size=2**20, dropout_rate=0.0)
    config.data.max_len = 256
    done = subprocess.run(
        [*cli_args(config), "--config.model.dropout_rate=0.0", "--plan", "v5e:2x2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: does not fit:"), done.stderr
    assert "HBM" in lines[0] and "Traceback" not in done.stderr  # the compiler says by how much


@pytest.mark.slow  # the TPU kernels compile in tests/test_aot_tpu.py; here the plan around them
def test_a_plan_with_our_pallas_attention_compiles_for_a_tpu_slice():
    # The Mosaic kernels run per chip in a shard_map over the mesh the step is traced under (sharding.tracing_mesh).
    # The one TPU compile of a whole train step with attention.impl=pallas in the default run.
    config = small_config(d_model=128)
    config.attention.impl = "pallas"
    topology = parse_topology("v5e:2x2")
    compiled, _ = plan.compile_train_step(config, topology, "data", make_mesh(list(topology.devices())), (16, 32, 32))
    hlo = compiled.as_text()
    assert all(kernel in hlo for kernel in ("attention_forward_tpu", "attention_dkdv_tpu", "attention_dq_tpu"))
    report = accelerators.memory_per_chip(compiled)
    assert report["total"] < topology.chip.hbm_bytes and compiled.cost_analysis()["flops"] > 0


def small_chip_topology(hbm_bytes: float):
    """v5e:2x2 as if its chips had `hbm_bytes` each: a fit boundary that tiny batches reach."""
    topology = parse_topology("v5e:2x2")
    return dataclasses.replace(topology, chip=dataclasses.replace(topology.chip, hbm_bytes=hbm_bytes))


def test_batch_search_halves_doubles_and_bisects_to_the_largest_batch_that_fits(monkeypatch):
    # The search's steps over a stand-in for the compile whose memory grows with the batch (each real compile takes
    # seconds: test_batch_search_bisects_to_the_largest_batch_that_fits, -m slow, runs the TPU compiler).
    compiled = []

    def plan_train_step(config, topology, mesh_mode):
        rows = config.data.batch_size
        compiled.append(rows)
        if rows > 256:  # the compiler refuses outright
            raise accelerators.DoesNotFit(f"does not fit: {rows} rows")
        total = 1_000 * rows
        return {"fits": total <= topology.chip.hbm_bytes, "memory_analysis_per_chip": {"total": total}, "rows": rows}

    monkeypatch.setattr(plan, "plan_train_step", plan_train_step)
    chips = small_chip_topology(40_000)  # the batch moves in steps of 8 rows (check_batch_shapes); 40 fit
    found = plan.search_batch(small_config(batch_size=512), chips, "data", tolerance=0)
    assert found["rows"] == 40 and found["search"]["largest_that_fits"] == 40
    assert found["search"]["first_that_does_not"] == 48
    assert compiled == [512, 256, 128, 64, 32, 48, 40]  # halving from a refusal, then bisecting
    assert [t["fits"] for t in found["search"]["tried"]] == [False] * 4 + [True, False, True]
    compiled.clear()
    found = plan.search_batch(small_config(batch_size=8), chips, "data", tolerance=0)
    assert found["rows"] == 40 and compiled == [8, 16, 32, 64, 48, 40]  # doubling while it fits
    with pytest.raises(accelerators.DoesNotFit, match="even data.batch_size=8, the smallest batch"):
        plan.search_batch(small_config(batch_size=8), small_chip_topology(1_000), "data")


def test_the_plan_report_prints_as_a_table_and_as_json(both_meshes):
    config = small_config()
    table = plan.render(both_meshes, config)
    assert "ESTIMATES" in table and "estimated step s" in table and "fsdp" in table
    assert table.splitlines()[-1] == f"chosen mesh: {both_meshes['chosen']}"
    assert json.loads(plan.render(both_meshes, config, as_json=True))["chosen"] == both_meshes["chosen"]


def decode_config():
    config = small_config()
    config.train.bleu_every = 1000  # validation BLEU runs: the train state stays in HBM while it decodes
    # The smallest batch the refilling search takes (2 scheduler.MIN_ROWS sentences), short sources: a quick compile.
    config.eval.batch_size, config.data.eval_max_len = 16, 32
    return config


@pytest.fixture(scope="module")
def decode_plan():
    return plan.plan_decode(decode_config(), parse_topology("v5e:2x2"), "data")


def test_the_decode_plan_is_consistent(both_meshes, decode_plan):
    train = both_meshes["meshes"]["data"]
    # Validation's batch: eval.batch_size of train.bleu_sentences, the longest source, beam 4, the last cache stage.
    assert [decode_plan[k] for k in ("beam_size", "sentences", "source_len", "search")] == [4, 16, 32, "refilling"]
    assert decode_plan["output_slots"] == 32 + 50 == decode_plan["cache_stages"][-1]
    programs = decode_plan["memory_analysis_per_chip"]
    assert set(programs) == {"start", "grow", "stage"} and decode_plan["peak_program"] == "stage"
    for memory in programs.values():  # the train step's sum rule
        parts = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"] + memory["generated_code"]
        assert memory["total"] == parts
    peak = programs["stage"]
    # temp may be 0: the TPU compiler reports no HBM temporaries for this tiny beam step.
    assert peak["argument"] >= train["per_chip_bytes"]["parameters"]
    assert peak["alias"] > 0  # the search state is donated from stage to stage
    resident = decode_plan["train_state_resident_bytes"]
    assert resident == train["per_chip_bytes"]["optimizer_state"] > 0
    assert decode_plan["total_bytes"] == peak["total"] + resident and decode_plan["fits"]
    # One step, not the loop's 82: XLA counts a while loop's body once; the formula leaves out the beam's top-k,
    # softmax and norms.
    count = decode_plan["flops_per_step"]
    assert 1.0 <= count["compiled_per_chip"] / count["formula"] < 1.5
    estimate = decode_plan["estimate"]
    assert estimate["step_s"] >= max(estimate["compute_s"], estimate["hbm_s"]) > 0
    assert estimate["s_per_output_token"] == pytest.approx(estimate["step_s"] / 16)
    assert "validation decoding" in plan.format_reports({"data": {**train, "decode": decode_plan}})


@pytest.mark.slow  # trimmed from the default run: the file keeps a fast representative
def test_a_small_eval_batch_is_planned_as_its_one_jitted_search(both_meshes):
    # Under 2 scheduler.MIN_ROWS sentences the Searcher runs the whole search in one call: that program is planned,
    # without a per-step estimate (XLA's count of it mixes the encoder with every cache stage's loop).
    config = small_config(d_model=32)
    config.eval.batch_size, config.data.eval_max_len = 8, 32
    decode = plan.plan_decode(config, parse_topology("v5e:2x2"), "data")
    assert decode["search"] == "one jitted call" and list(decode["memory_analysis_per_chip"]) == ["search"]
    assert decode["memory_analysis_per_chip"]["search"]["temp"] > 0 and decode["estimate"]["step_s"] is None
    assert "n/a" in plan.format_reports({"data": {**both_meshes["meshes"]["data"], "decode": decode}})


@pytest.mark.slow  # test_a_batch_that_cannot_fit_is_one_line_and_a_nonzero_exit takes the same CLI path
def test_an_eval_batch_that_cannot_fit_is_one_line_and_a_nonzero_exit():
    # 2^16 sentences of 256 source tokens, beam 4: the TPU compiler refuses the encoder's 74 GB, in seconds.
    config = small_config(d_model=32)
    rows = ["--config.train.bleu_sentences=65536", "--config.eval.batch_size=65536"]
    done = subprocess.run(
        [*cli_args(config), *rows, "--plan", "v5e:2x2"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: does not fit: validation's decoding"), lines
    assert "HBM" in lines[0] and "eval.batch_size" in lines[0] and "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_plan_whose_decoding_exceeds_the_chip_fails_after_its_report(both_meshes, monkeypatch):
    config = decode_config()
    config.eval.batch_size, config.data.eval_max_len = 64, 256  # decoding needs more than the train step
    decode = plan.plan_decode(config, parse_topology("v5e:2x2"), "data")
    train = both_meshes["meshes"]["data"]["memory_analysis_per_chip"]["total"]
    # Chips with room for the train step but not for validation's decoding beside the train state.
    hbm = (decode["total_bytes"] + train) / 2
    assert train < hbm < decode["total_bytes"]
    monkeypatch.setattr(plan, "parse_topology", lambda name: small_chip_topology(hbm))
    result = plan.run(config, "v5e:2x2")
    assert "NO" in plan.render(result, config)  # the table that train.py prints first says so
    with pytest.raises(accelerators.DoesNotFit, match="does not fit: validation's decoding .* lower eval.batch_size"):
        plan.check_fits(result, config)


@pytest.mark.slow
def test_batch_search_bisects_to_the_largest_batch_that_fits():
    config = small_config(batch_size=16)
    at_64 = plan.plan_train_step(plan.with_batch(config, 64), parse_topology("v5e:2x2"), "data")
    found = plan.search_batch(config, small_chip_topology(at_64["memory_analysis_per_chip"]["total"]), "data")
    assert found["fits"] and 64 <= found["search"]["largest_that_fits"] < found["search"]["first_that_does_not"]
    assert found["search"]["first_that_does_not"] - found["search"]["largest_that_fits"] <= 8  # one step of rows


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("jax_cuda12_plugin") is None, reason="needs requirements-aot.txt")
def test_a_gpu_plan_compiles():
    report = plan.plan_train_step(small_config(d_model=32), parse_topology("h100:1"), "data")
    assert report["topology"]["device_kind"] == "NVIDIA H100 80GB HBM3" and report["fits"]
    assert report["memory_analysis_per_chip"]["temp"] > 0 and report["flops_per_step"]["compiled"] > 0
