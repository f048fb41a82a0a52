"""Tuning spec of Gemma 3n's per-token operations (kernels/altup.cl): one case runs all seven kernels of a layer
(the router both ways, prediction, correction, the per-layer input into the streams, a magnitude-matched
projection accumulated at an offset, LAuReL's combination, the sparse gate), each on its own fresh inputs.

Shapes: m (rows), k (the hidden size), streams (A), n (the MLP's width, the sparse gate's row).
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops.altup import ALTUP, AltUp
from perfx.tuning.spec import Case, Spec, cached_per_params

EPS = 1e-6


def make_case(device, shape, rng) -> Case:
    m, k, a, n = shape["m"], shape["k"], shape["streams"], shape["n"]
    stride = m * k + 5   # the streams apart by more than their rows: a kernel that assumes m·k is caught
    f32 = np.float32

    def normal(*dims, scale=1.0):
        return (rng.standard_normal(dims) * scale).astype(f32)

    def spread(s):   # the A streams (A, m, k) laid out stride apart, the gaps random too
        flat = normal((a - 1) * stride + m * k)
        for j in range(a):
            flat[j * stride: j * stride + m * k] = s[j].ravel()
        return flat

    def gather(flat):
        return np.stack([flat[j * stride: j * stride + m * k].reshape(m, k) for j in range(a)])

    x, gamma = normal(m, k, scale=3.0), normal(k, scale=0.5) / f32(k)
    w_router = normal(a, k, scale=4.0)
    mix_pred, mix_corr = normal(a * a, a), normal(a, a)
    streams, coefs = normal(a, m, k), normal(m, a * a, scale=0.5)
    y, scale, gamma_c = normal(m, k), normal(m, a), normal(k)
    p, gamma_p = normal(m, k, scale=2.0), normal(k)
    target, proj, before = normal(m, k, scale=5.0), normal(m, k), normal(m, k)
    attn, laurel, act, xb = normal(m, k, scale=3.0), normal(m, k), normal(m, k), normal(m, k)
    g_a, g_l, g_f = normal(k), normal(k), normal(k)
    gu = normal(m, 2 * n, scale=2.0)
    z, weight, offset = 1.6448535, 0.25, 3

    up = device.upload
    x_d, gamma_d, w_d, pred_mix_d, corr_mix_d = up(x), up(gamma), up(w_router), up(mix_pred), up(mix_corr)
    streams_d, coefs_d, y_d, scale_d, gamma_c_d = up(spread(streams)), up(coefs), up(y), up(scale), up(gamma_c)
    p_d, gamma_p_d, target_d, proj_d = up(p), up(gamma_p), up(target), up(proj)
    attn_d, laurel_d, act_d, g_a_d, g_l_d, g_f_d = up(attn), up(laurel), up(act), up(g_a), up(g_l), up(g_f)
    gu_d = up(gu)
    router_pred, router_corr = device.empty((m, a * a), f32), device.empty((m, a), f32)
    predicted, corrected = device.empty((a - 1) * stride + m * k, f32), device.empty((a - 1) * stride + m * k, f32)
    first, added = device.empty((m, k), f32), device.empty((a - 1) * stride + m * k, f32)
    rescaled, x_out, xb_d = device.empty(offset + m * k, f32), device.empty((m, k), f32), device.empty((m, k), f32)
    sparse = device.empty((m, n), f32)
    added_in, rescaled_in = spread(streams), np.concatenate([np.full(offset, 7.0, f32), before.ravel()])
    made = cached_per_params(lambda params: AltUp(device, params))

    def launch(params):
        op = made(params)
        return [op.router(x_d, gamma_d, w_d, pred_mix_d, router_pred, m, k, a, a * a, EPS, 0.0),
                op.router(x_d, gamma_d, w_d, corr_mix_d, router_corr, m, k, a, a, EPS, 1.0),
                op.predict(streams_d, coefs_d, predicted, m, k, a, stride),
                op.correct(streams_d, y_d, scale_d, gamma_c_d, corrected, first, m, k, a, stride),
                op.add_normed(p_d, gamma_p_d, added, m, k, a, stride, 1, EPS),
                op.rescale(target_d, proj_d, rescaled, m, k, offset, weight, accumulate=True),
                op.laurel_combine(attn_d, laurel_d, act_d, g_a_d, g_l_d, g_f_d, x_out, xb_d, m, k, EPS),
                op.sparse_gate(gu_d, sparse, m, n, z)]

    def run(params):
        for buffer in (router_pred, router_corr, predicted, corrected, first, x_out, sparse):
            buffer.fill(f32(np.nan))
        # the in-place outputs: their fresh inputs first
        added.set(added_in)
        rescaled.set(rescaled_in)
        xb_d.set(xb)
        for event in launch(params):
            event.wait()
        out = rescaled.get()
        return {"router_pred": router_pred.get(), "router_corr": router_corr.get(),
                "predict": gather(predicted.get()), "correct": gather(corrected.get()), "first": first.get(),
                "add_normed": gather(added.get()), "rescale": out[offset:].reshape(m, k),
                "rescale_head": out[:offset], "laurel_x": x_out.get(), "laurel_xb": xb_d.get(),
                "sparse_gate": sparse.get()}

    s_corrected, s_first = reference.altup_correct(streams, y, scale, gamma_c)
    h, hb = reference.laurel_combine(attn, laurel, act, xb, g_a, g_l, g_f, EPS)
    expected = {"router_pred": reference.altup_router(x, gamma, w_router, mix_pred, EPS, 0.0),
                "router_corr": reference.altup_router(x, gamma, w_router, mix_corr, EPS, 1.0),
                "predict": reference.altup_predict(streams, coefs), "correct": s_corrected, "first": s_first,
                "add_normed": reference.altup_add_normed(p, gamma_p, streams, 1, EPS),
                "rescale": before + reference.altup_rescale(target, proj, weight),
                "rescale_head": np.full(offset, 7.0), "laurel_x": h, "laurel_xb": hb,
                "sparse_gate": reference.sparse_gate(gu, z)}
    return Case(expected=expected, run=run, launch=launch)


def programs(device, shape, params) -> None:
    """The kernels a run at ``params`` builds: the wrapper's, made when it is."""
    AltUp(device, params)


def _bytes(s) -> int:
    m, k, a, n = s["m"], s["k"], s["streams"], s["n"]
    row = 4 * m * k
    return (row * (2 * 2 + 2 * a + 3 * a + 1 + 3 * a - 1 + 3 + 6) + 4 * 2 * a * k + 12 * m * n)


ALTUP_SPEC = Spec(
    params=ALTUP,
    make_case=make_case,
    tolerance=1e-5,
    tolerance_why=("fp32 sums of k products or squares (a tree of WGS, each item's run sequential) and tanh, sqrt "
                   "and rsqrt (a few ulp in OpenCL) against float64, relative to each output's largest value: "
                   "at most 1.6e-7 seen on both CPU runtimes, 7.3e-7 for the sparse gate of a 45-wide row (its "
                   "cutoff's rounding moves every kept value); a missed row, stream or offset is O(1) off"),
    test_shapes=({"m": 1, "k": 2048, "streams": 4, "n": 8192}, {"m": 5, "k": 100, "streams": 4, "n": 97},
                 {"m": 3, "k": 37, "streams": 3, "n": 45}),
    bytes_moved=_bytes,
    reference=reference.altup_predict,
    fuzz_shapes=lambda st: st.fixed_dictionaries({"m": st.integers(1, 9), "k": st.integers(1, 700),
                                                  "streams": st.integers(1, 8), "n": st.integers(2, 900)}),
    oclgrind_shapes=({"m": 2, "k": 37, "streams": 4, "n": 45},),
    flops=lambda s: s["m"] * (s["k"] * (4 * s["streams"] * s["streams"] + 30) + 20 * s["n"]),
    programs=programs,
)
