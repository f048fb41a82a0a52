"""Constrained decoding's mask (kernels/logit_mask.cl): every test shape at the defaults, every candidate at one,
against the float64 reference, and what the draw after it makes of −∞ logits."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.logit_mask import LogitMask, mask_words
from perfx.ops.sample import Sample
from perfx.tuning.logit_mask import LOGIT_MASK


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(LOGIT_MASK), ids=[LOGIT_MASK.describe(s) for s in LOGIT_MASK.test_shapes])
def test_every_parameter_set_matches_reference(device, rng, index):
    assert_planned_sets(LOGIT_MASK, device, index, rng)


def test_a_mask_too_short_is_refused(device):
    logits = device.upload(np.ones(100, np.float32))
    with pytest.raises(PerfxError, match="mask holds 8 bytes where 16"):
        LogitMask(device)(logits, 100, device.upload(np.zeros(2, np.uint32)))


@pytest.mark.parametrize("top_p, min_p", [(1.0, 0.0), (0.9, 0.05)])
def test_the_draw_never_takes_a_masked_token(device, rng, top_p, min_p):
    """Two allowed tokens of 1003 (the rest −∞ after the mask), no top-p or min-p cut to hide a −∞ candidate:
    every draw, at many uniforms, is one of the two, as the reference's is."""
    v = 1003
    allowed = np.zeros(mask_words(v) * 32, bool)
    allowed[[17, 700]] = True
    mask = np.packbits(allowed.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).ravel()
    logits = (rng.standard_normal(v) * 3).astype(np.float32)
    logits_d, out = device.upload(logits), device.empty(1, np.int32)
    LogitMask(device)(logits_d, v, device.upload(mask)).wait()
    masked = logits_d.get()
    sample = Sample(device)
    for counter in range(40):
        out.set(np.full(1, -1, np.int32))
        for event in sample(logits_d, v, out, temperature=1.0, top_k=40, top_p=top_p, min_p=min_p, seed=7,
                            counter=counter):
            event.wait()
        token = int(out.get()[0])
        assert token in (17, 700)
        assert token == reference.sample(masked, [], 1.0, 40, top_p, min_p, 1.0, 7, counter)
