"""Gated DeltaNet: the float64 reference against two independent formulations (the explicit matrix form of the
delta rule and transformers' chunked algorithm), both kernels at every parameter set (each at one test shape),
chunked prefill followed by token-by-token decode from its state, and the error paths."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.ops.gated_delta_net import GatedDeltaNetChunked, GatedDeltaNetRecurrent
from perfx.tuning import relative_error
from perfx.tuning.gated_delta_net import CHUNKED, EPS, RECURRENT, random_gates

SPECS = {"recurrent": RECURRENT, "chunked": CHUNKED}


def random_sequence(rng, tokens, hk, hv, dk, dv):
    """q, k (T, Hk, d_k), v (T, Hv, d_v), g and β (T, Hv) in realistic ranges, and a random state."""
    gates, _ = random_gates(rng, tokens, hv, raw=False)
    q, k = (rng.standard_normal((tokens, hk, dk)) for _ in range(2))
    v = rng.standard_normal((tokens, hv, dv))
    return q, k, v, gates[:, :hv].astype(np.float64), gates[:, hv:].astype(np.float64), \
        rng.standard_normal((hv, dv, dk)) * 0.3


def expand(q, k, hv, head_map, scale):
    """q̂·scale and k̂ per v head (T, Hv, d_k)."""
    heads = reference.delta_net_heads(q.shape[1], hv, head_map)
    return reference.l2_normalize(q)[:, heads] * scale, reference.l2_normalize(k)[:, heads]


def matrix_form(q, k, v, g, beta, state, head_map):
    """S ← α·S·(I − β·k̂k̂ᵀ) + β·v·k̂ᵀ with S (d_v, d_k), o = S·q̂: the delta rule as one matrix update."""
    qn, kn = expand(q, k, v.shape[1], head_map, 1 / np.sqrt(q.shape[2]))
    state, out = state.copy(), np.empty_like(v)
    eye = np.eye(q.shape[2])
    for t in range(v.shape[0]):
        for h in range(v.shape[1]):
            a, b, kk = np.exp(g[t, h]), beta[t, h], kn[t, h]
            state[h] = a * state[h] @ (eye - b * np.outer(kk, kk)) + b * np.outer(v[t, h], kk)
            out[t, h] = state[h] @ qn[t, h]
    return out, state


def transformers_chunked(q, k, v, g, beta, state, head_map, chunk):
    """transformers' torch_chunk_gated_delta_rule in numpy, its state S (d_k, d_v) = our state transposed:
    the inverse (I + L)⁻¹ built by its row loop, chunks padded with zeros at the end."""
    qn, kn = expand(q, k, v.shape[1], head_map, 1 / np.sqrt(q.shape[2]))
    tokens = v.shape[0]
    pad = (-tokens) % chunk
    qn, kn, v, g, beta = (np.concatenate([x, np.zeros((pad,) + x.shape[1:])]) for x in (qn, kn, v, g, beta))
    out, final = np.empty_like(v), np.empty_like(state)
    below = np.tril(np.ones((chunk, chunk)), -1)
    for h in range(v.shape[1]):
        s = state[h].T.copy()
        for c in range(0, tokens + pad, chunk):
            qc, kc, vc, gc, bc = (x[c:c + chunk, h] for x in (qn, kn, v, g, beta))
            gc = np.cumsum(gc)
            decay = np.tril(np.exp(np.tril(gc[:, None] - gc[None, :])))
            attn = -((kc * bc[:, None]) @ kc.T * decay) * below
            for i in range(1, chunk):
                attn[i, :i] = attn[i, :i] + (attn[i, :i, None] * attn[:i, :i]).sum(0)
            attn += np.eye(chunk)
            value = attn @ (vc * bc[:, None])
            k_cumdecay = attn @ (kc * (bc * np.exp(gc))[:, None])
            v_new = value - k_cumdecay @ s
            out[c:c + chunk, h] = (qc * np.exp(gc)[:, None]) @ s + np.tril(qc @ kc.T * decay) @ v_new
            s = s * np.exp(gc[-1]) + (kc * np.exp(gc[-1] - gc)[:, None]).T @ v_new
        final[h] = s.T
    return out[:tokens], final


@pytest.mark.parametrize("head_map", ["tile", "interleave"])
@pytest.mark.parametrize("dims", [(2, 6, 24, 40), (1, 2, 64, 64), (2, 2, 128, 128)], ids=str)
def test_reference_matches_the_matrix_form(rng, dims, head_map):
    hk, hv, dk, dv = dims
    seq = random_sequence(rng, 9, hk, hv, dk, dv)
    out, state = reference.gated_delta_net(*seq, head_map=head_map)
    want_out, want_state = matrix_form(*seq, head_map)
    assert np.abs(out - want_out).max() < 1e-12 * np.abs(want_out).max()
    assert np.abs(state - want_state).max() < 1e-12 * np.abs(want_state).max()


@pytest.mark.parametrize("tokens", [19, 5, 16], ids=lambda t: f"T{t}")
def test_reference_matches_transformers_chunked_algorithm(rng, tokens):
    # chunks of 8: T = 19 ends on a partial chunk, T = 5 is below one chunk, T = 16 is two whole ones
    seq = random_sequence(rng, tokens, 2, 4, 32, 24)
    out, state = reference.gated_delta_net(*seq, head_map="interleave")
    want_out, want_state = transformers_chunked(*seq, "interleave", chunk=8)
    assert np.abs(out - want_out).max() < 1e-11 * np.abs(want_out).max()
    assert np.abs(state - want_state).max() < 1e-11 * np.abs(want_state).max()


def test_head_maps_and_gates(rng):
    """tile: v head h reads q/k head h mod Hk (np.tile); interleave: h // (Hv/Hk) (np.repeat); the gates of
    the projections: g = softplus(a + dt_bias)·ssm_a ≤ 0, β = sigmoid(b)."""
    q, k, v, g, beta, state = random_sequence(rng, 4, 2, 6, 16, 8)
    widened = (("tile", lambda x: np.tile(x, (1, 3, 1))), ("interleave", lambda x: np.repeat(x, 3, 1)))
    for head_map, widen in widened:
        out, final = reference.gated_delta_net(q, k, v, g, beta, state, head_map=head_map)
        same, same_final = reference.gated_delta_net(widen(q), widen(k), v, g, beta, state)
        np.testing.assert_allclose(out, same, rtol=0, atol=1e-13)
        np.testing.assert_allclose(final, same_final, rtol=0, atol=1e-13)
    assert np.abs(out - reference.gated_delta_net(q, k, v, g, beta, state, head_map="tile")[0]).max() > 1e-2
    a, b, dt_bias = rng.standard_normal((3, 5)) * 3
    ssm_a = -np.exp(rng.standard_normal(5))
    g, beta = reference.gated_delta_gates(a, b, dt_bias, ssm_a)
    np.testing.assert_allclose(g, np.log1p(np.exp(a + dt_bias)) * ssm_a, rtol=1e-14)
    np.testing.assert_allclose(beta, 1 / (1 + np.exp(-b)), rtol=1e-14)
    assert np.all(g <= 0)


def _cases():
    return [pytest.param(kind, i, id=f"{kind}-{SPECS[kind].describe(SPECS[kind].test_shapes[i])}")
            for kind in SPECS for i in swept(SPECS[kind])]


STRENGTH = {"recurrent": lambda shape: 1,
            "chunked": lambda shape: 2 if max(shape["d_k"], shape["d_v"]) >= 128 else 1}


@pytest.mark.sweep
@pytest.mark.parametrize("kind, index", _cases())
def test_every_parameter_set_matches_reference(device, rng, kind, index):
    """Each parameter set at one of the shapes (helpers.spec_checks.plan; the first has the most edges: GQA 3,
    d_k and d_v off every lane and row multiple, a tail after every chunk size, a qkv offset), and at each (each
    shape's d_k, d_v, head map and gate form make builds of their own) a covering subset, every value of every
    parameter, and for the chunked kernel at heads of 128 every pair (its tiles against the largest state rows),
    so each shape's decode step, head map, raw gates and head sizes meet every kind of variant."""
    assert_planned_sets(SPECS[kind], device, index, rng, STRENGTH[kind])


def as_float32(seq):
    """The sequence as the device sees it: (qkv (T, 2·Hk·d_k + Hv·d_v), gates (T, 2·Hv), state) float32, and
    the same values back as reference arguments."""
    q, k, v, g, beta, state = seq
    tokens = v.shape[0]
    qkv = np.concatenate([x.reshape(tokens, -1) for x in (q, k, v)], axis=1).astype(np.float32)
    gates = np.concatenate([g, beta], axis=1).astype(np.float32)
    state = state.astype(np.float32)
    hq, hv = q[0].size, g.shape[1]
    args = (qkv[:, :hq].reshape(q.shape), qkv[:, hq:2 * hq].reshape(k.shape), qkv[:, 2 * hq:].reshape(v.shape),
            gates[:, :hv], gates[:, hv:], state)
    return (qkv, gates, state), args


def run_launches(device, launches, qkv, gates, state0):
    """Run (op, tokens) launches one after another on one device state; (outputs (T, Hv·d_v), final state)."""
    state, outs, start = device.upload(state0), [], 0
    for op, tokens in launches:
        out = device.poisoned((tokens, op.out_size), np.float32)
        op(device.upload(qkv[start:start + tokens]), device.upload(gates[start:start + tokens]), state, out,
           tokens, eps=EPS).wait()
        outs.append(out.get())
        start += tokens
    return np.concatenate(outs), state.get()


def test_chunked_prefill_then_decode_continues_its_state(device, rng):
    """A prefill of 21 tokens in two chunked launches (13 then 8: the state carried across launches, a
    partial chunk in each), then three decode steps of the recurrent kernel from that device state; gates in
    their own buffer. Every output and the final state against the float64 recurrence over all 24 tokens."""
    hk, hv, dk, dv = 2, 4, 64, 48
    shape = {"n_k_heads": hk, "n_v_heads": hv, "d_k": dk, "d_v": dv}
    device_inputs, args = as_float32(random_sequence(rng, 24, hk, hv, dk, dv))
    want_out, want_state = reference.gated_delta_net(*args, eps=EPS)
    prefill, decode = GatedDeltaNetChunked(device, None, shape), GatedDeltaNetRecurrent(device, None, shape)
    out, state = run_launches(device, [(prefill, 13), (prefill, 8), (decode, 1), (decode, 1), (decode, 1)],
                              *device_inputs)
    assert relative_error(out, want_out.reshape(24, -1)) <= CHUNKED.tolerance
    assert relative_error(state, want_state) <= CHUNKED.tolerance


@pytest.mark.parametrize("kind", ["recurrent", "chunked"])
def test_the_tolerance_tells_wrong_maths_apart(device, rng, kind):
    """Within the tolerance of the reference, and far outside it for the other head map, no decay, or β = 1."""
    hk, hv, dk, dv, tokens = 2, 6, 40, 24, 9
    shape = {"n_k_heads": hk, "n_v_heads": hv, "d_k": dk, "d_v": dv}
    op = (GatedDeltaNetRecurrent if kind == "recurrent" else GatedDeltaNetChunked)(device, None, shape)
    device_inputs, (q, k, v, g, beta, state) = as_float32(random_sequence(rng, tokens, hk, hv, dk, dv))
    out = run_launches(device, [(op, tokens)], *device_inputs)[0].reshape(tokens, hv, dv)
    assert relative_error(out, reference.gated_delta_net(q, k, v, g, beta, state, eps=EPS)[0]) <= 1e-5
    for wrong in (reference.gated_delta_net(q, k, v, g, beta, state, head_map="interleave")[0],
                  reference.gated_delta_net(q, k, v, np.zeros_like(g), beta, state)[0],
                  reference.gated_delta_net(q, k, v, g, np.ones_like(beta), state)[0]):
        assert relative_error(out, wrong) > 100 * SPECS[kind].tolerance


def test_errors(device):
    shape = {"n_k_heads": 2, "n_v_heads": 4, "d_k": 32, "d_v": 32}
    with pytest.raises(PerfxError, match="4 v heads cannot share 3 q/k heads"):
        GatedDeltaNetRecurrent(device, None, {**shape, "n_k_heads": 3})
    with pytest.raises(PerfxError, match="at most 256"):
        GatedDeltaNetChunked(device, None, {**shape, "d_k": 320})
    with pytest.raises(PerfxError, match="positive integers"):
        GatedDeltaNetChunked(device, None, {**shape, "d_v": 0})
    with pytest.raises(PerfxError, match="head_map 'grouped' is not one of"):
        GatedDeltaNetRecurrent(device, None, {**shape, "head_map": "grouped"})
    with pytest.raises(PerfxError, match="is not one of"):
        GatedDeltaNetRecurrent(device, {"LANES1": 3, "ROWS1": 4}, shape)
    op = GatedDeltaNetRecurrent(device, None, shape)
    qkv, gates = device.empty((3, 256), np.float32), device.empty((3, 8), np.float32)
    state, out = device.empty((4, 32, 32), np.float32), device.empty((3, 128), np.float32)
    op(qkv, gates, state, out, 3).wait()
    with pytest.raises(PerfxError, match="qkv must hold 769 float32 for 3 token"):
        op(qkv, gates, state, out, 3, qkv_offset=1)
    with pytest.raises(PerfxError, match=r"qkv must hold 784 float32 for 3 token\(s\) \(offset 0, stride 264"):
        op(qkv, None, state, out, 3)   # gates None: each row [q | k | v | g | β], no room for them here
    with pytest.raises(PerfxError, match="gates must hold 24 float32 for 3"):
        op(qkv, device.empty((2, 8), np.float32), state, out, 3)
    with pytest.raises(PerfxError, match="stride 100 ≥ the 256 floats"):
        op(qkv, gates, state, out, 1, qkv_stride=100)
    with pytest.raises(PerfxError, match=r"state \(Hv·d_v·d_k float32\) holds 8192 bytes where 16384"):
        op(qkv, gates, device.empty((2, 32, 32), np.float32), out, 3)
    with pytest.raises(PerfxError, match="out must hold 384"):
        op(qkv, gates, state, device.empty((2, 128), np.float32), 3)
    with pytest.raises(PerfxError, match="tokens must be a positive integer"):
        op(qkv, gates, state, out, 0)
    raw = GatedDeltaNetChunked(device, None, {**shape, "raw_gates": True})
    with pytest.raises(PerfxError, match="raw gates .* need dt_bias and ssm_a"):
        raw(qkv, gates, state, out, 3)
