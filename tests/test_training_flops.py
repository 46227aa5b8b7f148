"""The matmul peak behind MFU: measured once per kind of machine and kept beside the compilation cache."""

import json

import jax
import pytest

from transformer_jax.training import metrics


@pytest.fixture
def measured(monkeypatch) -> list[float]:
    """measure_matmul_peak replaced by a counter that returns 5e10 (each call is one measurement)."""
    calls = []

    def fake() -> float:
        calls.append(5e10)
        return 5e10

    monkeypatch.setattr(metrics, "measure_matmul_peak", fake)
    return calls


def test_a_kept_peak_is_used_without_measuring(tmp_path, measured):
    (tmp_path / metrics.PEAK_FILE).write_text(json.dumps({metrics.peak_key(): 1.25e11}))
    assert metrics.matmul_peak(tmp_path) == 1.25e11
    assert measured == []


def test_the_first_measurement_is_kept_and_reused(tmp_path, measured):
    assert metrics.matmul_peak(tmp_path) == 5e10
    assert metrics.matmul_peak(tmp_path) == 5e10
    assert len(measured) == 1
    assert json.loads((tmp_path / metrics.PEAK_FILE).read_text()) == {metrics.peak_key(): 5e10}
    assert [p.name for p in tmp_path.iterdir()] == [metrics.PEAK_FILE]  # no temporary file left behind


def test_another_device_kind_does_not_reuse_the_peak(tmp_path, measured, monkeypatch):
    mine = metrics.peak_key()
    (tmp_path / metrics.PEAK_FILE).write_text(json.dumps({mine: 1.25e11}))
    device = jax.devices()[0]

    class OtherKind:
        platform, device_kind = device.platform, "a different chip"

    monkeypatch.setattr(jax, "devices", lambda *a: [OtherKind()])
    other = metrics.peak_key()
    assert other != mine
    assert metrics.matmul_peak(tmp_path) == 5e10
    assert len(measured) == 1
    assert json.loads((tmp_path / metrics.PEAK_FILE).read_text()) == {mine: 1.25e11, other: 5e10}
    monkeypatch.undo()
    assert metrics.matmul_peak(tmp_path) == 1.25e11  # this device's entry is kept beside the other's


def test_other_settings_key_the_peak_apart(monkeypatch):
    key = metrics.peak_key()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    assert metrics.peak_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(jax, "__version__", "0.0.1")
    assert metrics.peak_key() != key


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", json.dumps({"x": "fast"})])
def test_a_damaged_file_is_measured_again_and_replaced(tmp_path, measured, content):
    (tmp_path / metrics.PEAK_FILE).write_text(content)
    assert metrics.matmul_peak(tmp_path) == 5e10
    assert json.loads((tmp_path / metrics.PEAK_FILE).read_text())[metrics.peak_key()] == 5e10


def test_without_a_directory_or_with_an_unwritable_one_it_is_measured_every_time(tmp_path, measured):
    assert metrics.matmul_peak(None) == 5e10
    missing = tmp_path / "not-there"  # cannot be written into
    assert metrics.matmul_peak(missing) == 5e10
    assert len(measured) == 2
    assert not missing.exists()
