"""Shared tables and verdicts of the data formats."""

from __future__ import annotations

import numpy as np
import pytest

from cat.formats.tables import feature_verdict


def _plain_verdict(feats):
    finite = np.isfinite(feats)
    if finite.all():
        return ""
    nan = int(np.isnan(feats).sum())
    return f"non_finite nan={nan} inf={int(feats.size - finite.sum()) - nan}"


@pytest.mark.parametrize("dtype", ["float16", "float32", ">f2"])
@pytest.mark.parametrize("values", [
    [], [0.0], [65504.0, -65504.0, 6e-8, -0.0], [np.inf], [-np.inf], [np.nan],
    [1.0, np.nan, np.inf, -np.inf, np.nan], [-np.nan, 2.0],
])
def test_feature_verdict_equals_a_plain_isfinite_count(dtype, values):
    feats = np.resize(np.asarray(values, np.float64), 3 * len(values)).reshape(-1, 3)
    feats = feats.astype(dtype)
    for view in (feats, feats[::2], np.asfortranarray(np.tile(feats, (1, 2)))):
        assert feature_verdict(view) == _plain_verdict(view)


def test_feature_verdict_sees_every_float16_bit_pattern():
    patterns = np.arange(1 << 16, dtype=np.uint16)
    for bits in (patterns, patterns[::-1].copy()):
        feats = bits.view(np.float16).reshape(-1, 16)
        assert feature_verdict(feats) == _plain_verdict(feats) != ""
        finite = feats[np.isfinite(feats).all(axis=1)]
        assert feature_verdict(finite) == ""
        for row in np.flatnonzero(~np.isfinite(feats).all(axis=1)):
            assert feature_verdict(feats[row:row + 1]) == _plain_verdict(feats[row:row + 1])
