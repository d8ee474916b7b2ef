"""Checks on two gloo ranks on CPU, one spawn running every check of
tests/distributed_two_rank_checks.py: int8 activations through tensor-parallel experts, and
checkpoints the sharded loaders refuse. The tests assert on what each rank reported."""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.tensor.parallel")
pytest.importorskip("transformers")
import torch.distributed as dist  # noqa: E402

from distributed_checks import spawn  # noqa: E402

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(WORLD, str(tmp_path_factory.mktemp("two")), "distributed_two_rank_checks")


def _values(ranks, check):
    for r, res in enumerate(ranks):
        assert res[check]["ok"], f"rank {r} of {WORLD}: {res[check]['error']}"
    return [res[check]["value"] for res in ranks]


def test_int8_activations_through_a_tensor_parallel_switch_linear(ranks):
    # Each rank's part is the int8 product of its rows (colwise) or its whole blocks of 32 of x
    # (rowwise): within float32 rounding of float64 W times the int8-quantized x, as the layer
    # whole is; the exact product is not (the int8 step is far above that bound).
    for v in _values(ranks, "int8_switch_linear"):
        for name, c in v.items():
            assert c["activations"] == "int8", name
            assert c["whole_ratio"] <= 1 and c["ratio"] <= 1, (name, c)
            assert c["exact_ratio"] > 10, (name, c)
        assert v["colwise"]["equal_whole"]  # whole rows of x and W: the same sums


def test_non_finite_expert_scales_are_refused_by_the_sharded_loaders(ranks):
    # load_mlx and from_pretrained refuse them (tests/test_moe_mlx_lm.py EXPERT_FILE_EDITS); each
    # rank of the sharded loaders checks the slice it reads, which holds the bad value here.
    for v in _values(ranks, "non_finite_expert_scales"):
        assert len(v) == 4
        for case, c in v.items():
            assert c["refused"] is not None, case
            assert f"tensor '{c['key']}' (F32) holds NaN or Inf: the file is corrupt" in c["refused"], (case, c)


@pytest.mark.parametrize("difference", ["config", "dtype", "shape"])
def test_ranks_given_checkpoints_differing_in_one_respect_refuse_the_load(ranks, difference):
    # The digest covers config.json and each tensor's dtype and shape, each on its own: the last
    # rank's copy differs from the first rank's folder in that alone (tests/test_distributed.py's
    # folders differ in all three at once).
    values = _values(ranks, "other_checkpoints")
    base = values[0]["folders"][0]
    for v in values:
        message = v[difference]
        assert message is not None and "the ranks were given different checkpoints" in message, message
        assert f"rank 0: {base} (" in message and f"rank {WORLD - 1}: {base}-{difference} (" in message, message
