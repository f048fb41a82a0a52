"""Tuning spec of sampling on the device (kernels/sample.cl): the token drawn at a (seed, counter) against the
float64 reference's draw with the same uniform (``reference.sample``).

Shape: v (vocabulary), top_k (0: none), temperature (0: the penalised argmax), top_p, min_p, penalty (the
repetition penalty) and history (ids in the penalty's window, up to 256, duplicates among them).

A case keeps clear of the places where fp32 and float64 may honestly disagree: its logits are drawn afresh
until no filter's boundary (the top_k-th against the next logit, a cumulative probability against top_p, a
probability against min_p times the largest) lies within 1e-4 of deciding otherwise, and its counter is
stepped until the uniform lies at least 1e-4 of the kept mass from every cumulative boundary. Elsewhere the
device's fp32 sums (relative error ~1e-6) cannot move the draw, so the token is exact or wrong.
"""

from __future__ import annotations

import numpy as np

from perfx import reference
from perfx.ops import sample
from perfx.ops.sample import Sample
from perfx.tuning.spec import Case, Spec, cached_per_params

MARGIN = 1e-4   # fp32's sums over at most 128 kept tokens stay within ~1e-5 of float64: ten times clear


def _history(rng, logits: np.ndarray, h: int) -> np.ndarray:
    """h ids: a few of the largest logits (the penalty moves them across the top-k boundary), repeats, and
    random others."""
    v = len(logits)
    top = np.argsort(-logits, kind="stable")[:max(1, h // 4)]
    ids = np.concatenate([top, rng.integers(0, v, h)])[:h]
    if h >= 2:
        ids[-1] = ids[0]   # a repeat: penalised once
    return ids.astype(np.int32)


def _clear_filters(penalised: np.ndarray, shape) -> bool:
    """Whether no filter of ``shape`` is within MARGIN of deciding otherwise on these penalised logits."""
    t, v = shape["temperature"], len(penalised)
    order = np.argsort(-penalised, kind="stable")
    ranked = penalised[order]
    k = shape["top_k"] if 0 < shape["top_k"] < v else v
    if t == 0:
        return v == 1 or ranked[0] - ranked[1] > MARGIN
    if k < v and ranked[k - 1] - ranked[k] <= MARGIN:
        return False
    y = ranked[:k] / t
    cumulative = np.cumsum(np.exp(y - y[0])) / np.exp(penalised / t - y[0]).sum()
    if shape["top_p"] < 1 and np.min(np.abs(cumulative - shape["top_p"])) <= MARGIN:
        return False
    return not (shape["min_p"] > 0 and np.min(np.abs(y - y[0] - np.log(shape["min_p"]))) <= MARGIN)


def _clear_counter(penalised, shape, seed: int, start: int) -> int:
    """The first counter from ``start`` whose uniform lies clear of every cumulative boundary of the draw."""
    probs = reference.sampling_probs(penalised, shape["temperature"], shape["top_k"], shape["top_p"],
                                     shape["min_p"])
    cumulative = np.cumsum(np.sort(probs)[::-1])
    cumulative = cumulative[: np.count_nonzero(probs)]
    counter = start
    while np.min(np.abs(reference.sampling_uniform(seed, counter) - cumulative)) <= MARGIN:
        counter += 1
    return counter


def make_sample_case(device, shape, rng) -> Case:
    v, h = shape["v"], shape["history"]
    for _ in range(1000):
        logits = (rng.standard_normal(v) * 3).astype(np.float32)
        history = _history(rng, logits, h)
        penalised = reference.apply_repetition_penalty(logits, history, shape["penalty"])
        if _clear_filters(penalised, shape):
            break
    seed = int(rng.integers(0, 2**63))
    counter = int(rng.integers(0, 2**40))
    if shape["temperature"] > 0:
        counter = _clear_counter(penalised, shape, seed, counter)
    expected = reference.sample(logits, history, shape["temperature"], shape["top_k"], shape["top_p"],
                                shape["min_p"], shape["penalty"], seed, counter)
    logits_d = device.upload(logits)
    history_d = device.upload(history) if h else None
    out = device.empty(1, np.int32)
    made = cached_per_params(lambda params: Sample(device, params))
    settings = {name: shape[name] for name in ("temperature", "top_k", "top_p", "min_p", "penalty")}

    def launch(params):
        return made(params)(logits_d, v, out, history=history_d, h=h, seed=seed, counter=counter, **settings)

    def run(params):
        out.set(np.full(1, -1, np.int32))
        for event in launch(params):
            event.wait()
        return {"token": out.get().astype(np.float64)}

    return Case(expected={"token": np.array([expected], np.float64)}, run=run, launch=launch)


def _shape(v, top_k, temperature, top_p=1.0, min_p=0.0, penalty=1.0, history=0) -> dict:
    return {"v": v, "top_k": top_k, "temperature": temperature, "top_p": top_p, "min_p": min_p,
            "penalty": penalty, "history": history}


def fuzz_sample(st):
    """V up to 40 000 and the settings SamplingConfig allows that the device serves (top_k 1..64, or none
    where V ≤ 64), a history of up to 256 ids."""
    @st.composite
    def draw(draw):
        v = draw(st.integers(1, 40000))
        top_k = draw(st.integers(1, 64)) if v > 64 or draw(st.booleans()) else 0
        return _shape(v, top_k, draw(st.sampled_from([0.0, 0.7, 1.0, 1.3])), draw(st.sampled_from([1.0, 0.9, 0.5])),
                      draw(st.sampled_from([0.0, 0.05, 0.2])), draw(st.sampled_from([1.0, 1.3, 0.8])),
                      draw(st.integers(0, 256)))
    return draw()


SAMPLE = Spec(
    params=sample.PARAMS,
    make_case=make_sample_case,
    programs=lambda device, shape, params: Sample(device, params),
    tolerance=0.0,
    tolerance_why=("a token id: the float64 reference's draw with the same uniform, or wrong; the case keeps "
                   "every filter boundary and the uniform 1e-4 clear of where fp32 could decide otherwise"),
    test_shapes=(
        _shape(49157, 40, 0.7, 0.9, 0.05, 1.3, 100),    # SmolLM2's vocabulary + 5: every filter and the penalty
        _shape(1003, 5, 1.3, 1.0, 0.0, 1.3, 256),       # a full window, top-5
        _shape(32001, 100, 1.0, 0.95, 0.0, 1.0, 0),     # top_k above 64: TOPK 128 only
        _shape(50, 0, 1.0, 1.0, 0.05, 0.8, 7),          # no top-k (V ≤ TOPK), a penalty below 1 raises logits
        _shape(7, 0, 0.0, 1.0, 0.0, 1.5, 3),            # temperature 0: the penalised argmax
    ),
    bytes_moved=lambda s: 4 * s["v"] + 4 * s["history"] + 4,
    reference=reference.sample,
    fuzz_shapes=fuzz_sample,
    oclgrind_shapes=(
        _shape(203, 7, 0.9, 0.9, 0.05, 1.3, 20),        # chunks of up to 4 logits, groups past V
        _shape(16384, 7, 0.9, 0.9, 0.05, 1.3, 20),      # whole chunks of 256 (4·TOPK at TOPK 64) to merge
        _shape(16450, 7, 0.9, 0.9, 0.05, 1.0, 0),       # chunks of 258: the bound, then the gather
    ),
    flops=lambda s: 4 * s["v"],
)
