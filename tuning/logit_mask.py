"""Tuning spec of constrained decoding's mask (kernels/logit_mask.cl): the logits after the mask against the
float64 reference's (``reference.logit_mask``).

Shape: n (the vocabulary), rows (sequences, each with its own mask) and allowed (the share of tokens the mask
allows; a grammar allows anything from one token to nearly all of them).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops import logit_mask
from perfx.ops.logit_mask import LogitMask, mask_words
from perfx.tuning.spec import Case, Spec, cached_per_params


def make_logit_mask_case(device, shape, rng) -> Case:
    n, rows = shape["n"], shape["rows"]
    # Fresh non-zero logits each run stand in for the poisoned output (the op is in place): a forbidden logit
    # left unwritten stays finite and shows; an allowed one must come back bit for bit.
    logits = (rng.standard_normal((rows, n)) * 3 + 0.5).astype(np.float32)
    allowed = rng.random((rows, n)) < shape["allowed"]
    allowed[np.arange(rows), rng.integers(n, size=rows)] = True   # a grammar allows at least one token
    bits = rng.random((rows, mask_words(n) * 32)) < 0.5   # bits past V: ignored, whatever they hold
    bits[:, :n] = allowed
    mask = np.packbits(bits.reshape(rows, -1, 32)[:, :, ::-1], axis=2).view(">u4").astype(np.uint32)
    mask = mask.reshape(rows, -1)
    masked = reference.logit_mask(logits, mask)
    expected = {"forbidden": np.isinf(masked).astype(np.float64), "kept": np.where(allowed, masked, 0.0)}
    logits_d, mask_d = device.upload(logits), device.upload(mask)
    made = cached_per_params(lambda params: LogitMask(device, params))

    def launch(params):
        return [made(params)(logits_d, n, mask_d, rows)]

    def run(params):
        logits_d.set(logits)
        launch(params)[0].wait()
        got = logits_d.get().astype(np.float64)
        forbidden = np.isneginf(got)
        return {"forbidden": forbidden.astype(np.float64), "kept": np.where(forbidden, 0.0, got)}

    return Case(expected=expected, run=run, launch=launch)


def programs(device, shape, params) -> None:
    """The kernel a run at ``params`` builds: the wrapper's, made when it is."""
    LogitMask(device, params)


LOGIT_MASK = Spec(
    params=logit_mask.PARAMS,
    make_case=make_logit_mask_case,
    tolerance=0.0,
    tolerance_why=("no arithmetic: a forbidden logit is −∞ and an allowed one is untouched, bit for bit, or the "
                   "kernel is wrong"),
    test_shapes=({"n": 49157, "rows": 1, "allowed": 0.3}, {"n": 1003, "rows": 3, "allowed": 0.01},
                 {"n": 32001, "rows": 1, "allowed": 0.97}, {"n": 5, "rows": 4, "allowed": 0.5}),
    bytes_moved=lambda s: s["rows"] * (s["n"] // 8 + int(4 * s["n"] * (1 - s["allowed"]))),
    reference=reference.logit_mask,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"n": st.integers(1, 40000), "rows": st.integers(1, 8),
                                                  "allowed": st.sampled_from([0.001, 0.1, 0.5, 0.99])}),
    oclgrind_shapes=({"n": 203, "rows": 2, "allowed": 0.4},),
    programs=programs,
)
