"""benchmarks/fresh_process.py's CTranslate2 side: the process variants it races, and the ratios it reports."""

from __future__ import annotations

import json

from benchmarks import fresh_process


def test_ctranslate2_runs_with_its_threads_inside_one_translation_and_across_translations(tmp_path):
    job = {"model_dir": "m", "threads": 2, "beam_size": 4}
    commands = fresh_process._ctranslate2_commands(job, tmp_path, "beam4")
    jobs = {kind: json.loads(open(command[-1], encoding="utf-8").read()) for kind, command in commands.items()}
    assert jobs["ctranslate2"]["one_call"] is False and jobs["ctranslate2"]["threads"] == 2
    assert jobs["ctranslate2_one_call"]["one_call"] is True and "inter_threads" not in jobs["ctranslate2_one_call"]
    inter = jobs["ctranslate2_one_call_inter"]
    assert inter["one_call"] is True and inter["inter_threads"] == 2 and inter["threads"] == 1
    assert all(command[1:3] == ["-m", "benchmarks.ctranslate2_process"] for command in commands.values())


def test_ratios_are_over_each_variant_and_the_fastest():
    runs = {"ours_cold": [12.0], "ours_warm": [], "ctranslate2": [10.0], "ctranslate2_one_call_inter": [8.0, 7.5]}
    ratios = fresh_process._ratios(runs)
    assert ratios["cold_over_ctranslate2"] == 1.2 and ratios["cold_over_ctranslate2_one_call_inter"] == 1.6
    assert ratios["cold_over_ctranslate2_fastest"] == 1.6 and ratios["warm_over_ctranslate2_fastest"] is None
