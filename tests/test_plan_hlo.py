"""Reading collectives out of compiled HLO text (no compiler needed): counts, bytes, loops and async ops."""

from __future__ import annotations

import pytest

from transformer_jax.plan.accelerators import collectives

HLO = """HloModule jit_train_step

%body.7 (param.1: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %all-reduce.3 = f32[1024]{0} all-reduce(%gte.2), channel_id=1, replica_groups=[1,4]<=[4], to_apply=%add
  ROOT %tuple.9 = (s32[], f32[1024]{0}) tuple(%i, %all-reduce.3)
}

ENTRY %main.12 (p0: bf16[8,128], p1: f32[1024]) -> f32[1024] {
  %all-gather.1 = bf16[32,128]{1,0:T(8,128)(2,1)} all-gather(%p0), channel_id=2, dimensions={0}
  %all-gather-start.2 = (bf16[8,128]{1,0}, bf16[32,128]{1,0}) all-gather-start(%p0), channel_id=3
  %all-gather-done.2 = bf16[32,128]{1,0} all-gather-done(%all-gather-start.2)
  %while.5 = (s32[], f32[1024]{0}) while(%init), condition=%cond.6, body=%body.7, TRIP_COUNT
  ROOT %reduce-scatter.4 = f32[256]{0} reduce-scatter(%p1), channel_id=4, dimensions={0}, to_apply=%add
}
""".replace("TRIP_COUNT", 'backend_config={"known_trip_count":{"n":"3"}}')


def test_collectives_are_counted_per_step_with_their_bytes():
    found = collectives(HLO, chips=4)
    ops = found["ops"]
    assert ops["all-gather"] == {"count": 2, "bytes": 2 * 32 * 128 * 2}  # the async pair counts once, at its start
    assert ops["all-reduce"] == {"count": 3, "bytes": 3 * 1024 * 4}  # inside a loop of 3 iterations
    assert ops["reduce-scatter"] == {"count": 1, "bytes": 256 * 4}
    assert ops["all-to-all"]["count"] == ops["collective-permute"]["count"] == 0
    ring = 2 * 32 * 128 * 2 * 3 / 4 + 3 * 1024 * 4 * 2 * 3 / 4 + 256 * 4 * 3
    assert found["wire_bytes_per_chip"] == pytest.approx(ring)


def test_one_chip_puts_nothing_on_the_wire():
    assert collectives(HLO, chips=1)["wire_bytes_per_chip"] == 0
