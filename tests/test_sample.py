"""Sampling on the device (kernels/sample.cl): every test shape at the defaults, every parameter set at one, the
token equal to the float64 reference's draw with the same Philox uniform, the draws' distribution against the
host sampler's ``sampling_probs`` by a chi-square test, the counter-based generator against Random123's known
answers, and the settings the device refuses."""

import numpy as np
import pytest

from helpers.spec_checks import assert_planned_sets, swept
from perfx import reference
from perfx.errors import PerfxError
from perfx.generate import SamplingConfig, apply_repetition_penalty, sampling_probs
from perfx.ops.sample import Sample
from perfx.tuning.sample import MARGIN, SAMPLE


@pytest.mark.sweep
@pytest.mark.parametrize("index", swept(SAMPLE), ids=[SAMPLE.describe(s) for s in SAMPLE.test_shapes])
def test_every_parameter_set_matches_reference(device, rng, index):
    assert_planned_sets(SAMPLE, device, index, rng)


def test_philox_matches_random123_known_answers():
    # Random123's kat_vectors for philox4x32_10
    assert reference.philox4x32((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    assert reference.philox4x32((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == (0x408F276D, 0x41C83B0E, 0xA20BC7C6,
                                                                          0x6D5451FD)
    assert reference.philox4x32((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == (
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)
    u = [reference.sampling_uniform(7, c) for c in range(2000)]
    assert 0 <= min(u) and max(u) < 1 and abs(np.mean(u) - 0.5) < 0.02


def test_the_host_sampler_uses_the_reference_distribution():
    # one definition of the distribution: the host sampler's is the one the device is checked against
    assert sampling_probs is reference.sampling_probs
    assert apply_repetition_penalty is reference.apply_repetition_penalty


def _draws(device, sampler, logits, history, config, seed, counters) -> np.ndarray:
    logits_d, out = device.upload(np.asarray(logits, np.float32)), device.empty(1, np.int32)
    history_d = device.upload(np.asarray(history, np.int32)) if len(history) else None
    got = []
    for counter in counters:
        sampler(logits_d, len(logits), out, temperature=config.temperature, top_k=config.top_k,
                top_p=config.top_p, min_p=config.min_p, penalty=config.repetition_penalty, history=history_d,
                h=len(history), seed=seed, counter=counter)[-1].wait()
        got.append(int(out.get()[0]))
    return np.array(got)


def test_each_draw_is_the_reference_draw_with_the_same_uniform(device, rng):
    """200 counters, V = 30 011: where the uniform lies clear of every cumulative boundary (MARGIN of the mass;
    the few within it are skipped, as fp32 sums may honestly fall either side), the device's token is the
    float64 draw's."""
    v, seed = 30011, 987654321987
    logits = (rng.standard_normal(v) * 2.5).astype(np.float32)
    history = np.concatenate([np.argsort(-logits)[:6], rng.integers(0, v, 60)]).astype(np.int32)
    config = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02, repetition_penalty=1.2)
    probs = sampling_probs(apply_repetition_penalty(logits, history, 1.2), 0.8, 50, 0.9, 0.02)
    cumulative = np.cumsum(np.sort(probs)[::-1][:np.count_nonzero(probs)])
    counters = [c for c in range(200) if np.min(np.abs(reference.sampling_uniform(seed, c) - cumulative)) > MARGIN]
    assert len(counters) > 150
    got = _draws(device, Sample(device), logits, history, config, seed, counters)
    want = [reference.draw_token(probs, reference.sampling_uniform(seed, c)) for c in counters]
    assert list(got) == want
    assert len(set(want)) > 3


def _chi_square_limit(df: int, z: float = 3.090) -> float:
    """The chi-square statistic exceeded with probability 1e-3 (z: the normal's 0.999 quantile), by
    Wilson and Hilferty's cube-root approximation (within 1% of the quantile from df = 3)."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


CHI_SQUARE_SETTINGS = [
    SamplingConfig(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0),
    SamplingConfig(temperature=1.3, top_k=40, top_p=1.0, min_p=0.0),
    SamplingConfig(temperature=1.0, top_k=40, top_p=0.9, min_p=0.0),
    SamplingConfig(temperature=1.0, top_k=40, top_p=1.0, min_p=0.05),
    SamplingConfig(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0, repetition_penalty=1.3),
]


@pytest.mark.parametrize("config", CHI_SQUARE_SETTINGS,
                         ids=[f"t{c.temperature}-k{c.top_k}-p{c.top_p}-m{c.min_p}-r{c.repetition_penalty}"
                              for c in CHI_SQUARE_SETTINGS])
def test_draws_follow_the_host_distribution(device, config):
    """3 000 counters over V = 48 (a fixed seed and fixed logits: the test draws the same tokens every run, so it
    cannot flake): the counts against ``sampling_probs`` by a chi-square test at the 1e-3 level over the
    tokens expected 5 times or more (the rest pooled), and the total-variation distance within five standard
    deviations of its mean under ``sampling_probs``."""
    v, n, seed = 48, 3000, 20261205
    logits = np.random.default_rng(5).standard_normal(v).astype(np.float32) * 1.5
    history = np.array([int(np.argmax(logits)), 3, 3, 17, 40], np.int32)
    probs = sampling_probs(apply_repetition_penalty(logits, history, config.repetition_penalty),
                           config.temperature, config.top_k, config.top_p, config.min_p)
    got = _draws(device, Sample(device), logits, history, config, seed, range(n))
    counts = np.bincount(got, minlength=v)
    assert counts[probs == 0].sum() == 0, "a token the filters drop was drawn"
    expected = n * probs
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    observed, wanted = observed[wanted > 0], wanted[wanted > 0]
    chi_square = float(np.sum((observed - wanted) ** 2 / wanted))
    assert chi_square < _chi_square_limit(len(wanted) - 1), (chi_square, len(wanted))
    # total variation: its mean under the right distribution is ½·Σ √(2/π)·√(p(1 − p)/N) (≈ 0.046 at 40
    # near-even tokens), its standard deviation ½·√((1 − 2/π)·Σ p(1 − p)/N) (≈ 0.005): five of them above
    spread = probs * (1 - probs) / n
    mean_tv, sd_tv = 0.5 * np.sqrt(2 / np.pi) * np.sqrt(spread).sum(), 0.5 * np.sqrt((1 - 2 / np.pi) * spread.sum())
    assert 0.5 * np.abs(counts / n - probs).sum() < mean_tv + 5 * sd_tv


def test_the_device_refuses_what_it_does_not_serve(device):
    sampler = Sample(device, {"TOPK": 64, "GROUPS": 64})
    assert sampler.supports(SamplingConfig(top_k=40), 49152)
    assert sampler.supports(SamplingConfig(top_k=64), 49152)
    assert not sampler.supports(SamplingConfig(top_k=65), 49152)     # above TOPK
    assert not sampler.supports(SamplingConfig(top_k=0), 49152)      # no top-k over more than TOPK tokens
    assert sampler.supports(SamplingConfig(top_k=0), 64)             # ... but over TOPK tokens or fewer
    assert sampler.supports(SamplingConfig(top_k=500), 60)           # top_k ≥ V: no top-k
    assert sampler.supports(SamplingConfig(temperature=0, top_k=0, repetition_penalty=1.3), 262144)
    assert Sample(device, {"TOPK": 128, "GROUPS": 64}).supports(SamplingConfig(top_k=128), 49152)
    logits, out = device.upload(np.zeros(1000, np.float32)), device.empty(1, np.int32)
    with pytest.raises(PerfxError, match="not served on the device"):
        sampler(logits, 1000, out, temperature=1.0, top_k=0)
    with pytest.raises(PerfxError, match="last 256"):
        sampler(logits, 1000, out, temperature=1.0, top_k=5, history=device.upload(np.zeros(300, np.int32)),
                h=300)
    with pytest.raises(PerfxError, match="top_p"):
        sampler(logits, 1000, out, temperature=1.0, top_k=5, top_p=0.0)


@pytest.mark.parametrize("params", [{"TOPK": 64, "GROUPS": 16}, {"TOPK": 128, "GROUPS": 16}])
def test_work_items_holding_most_of_the_best(device, rng, params):
    """A quarter of the work-items hold every large logit, each work-item's above the one before: the first
    scan's bound is the lowest of those work-items' 4th best, which every logit of the others beats, so ~950
    keys reach it (more than 4·TOPK) and the exact third scan runs. The draws still equal the reference's
    (top_k = TOPK, the widest)."""
    topk, v = params["TOPK"], 16 * 4096
    logits = rng.standard_normal(v).astype(np.float32)
    lane = (np.arange(v) % 4096) % topk                   # the work-item of each group that reads each logit
    share = lane < topk // 4
    logits[share] += 20 + 2 * lane[share]
    config = SamplingConfig(temperature=1.0, top_k=topk, top_p=1.0, min_p=0.0)
    probs = sampling_probs(logits, 1.0, topk, 1.0, 0.0)
    cumulative = np.cumsum(np.sort(probs)[::-1][:np.count_nonzero(probs)])
    seed = 11
    counters = [c for c in range(40) if np.min(np.abs(reference.sampling_uniform(seed, c) - cumulative)) > MARGIN]
    got = _draws(device, Sample(device, params), logits, [], config, seed, counters)
    assert list(got) == [reference.draw_token(probs, reference.sampling_uniform(seed, c)) for c in counters]


def _keys(x: np.ndarray, first: int) -> np.ndarray:
    """kernels/sample.cl's make_key of fp32 values x at ids first, first + 1, …: the value's bits made monotonic
    above, the id inverted below (so the lower id of a tie is the larger key)."""
    bits = x.astype(np.float32).view(np.uint32)
    monotonic = np.where(bits & 0x80000000, ~bits, bits | 0x80000000).astype(np.uint64)
    ids = np.arange(first, first + len(x), dtype=np.uint64)
    return (monotonic << np.uint64(32)) | (~ids & np.uint64(0xFFFFFFFF))


def _logits_of(kind: str, v: int, params: dict, rng) -> np.ndarray:
    """V logits of a kind: "normal"; "ties" (all equal but 300: most groups keep ties, to the lower id); "masked"
    (−∞ but 100, as a grammar's mask leaves them); "lanes": the work-items of a group reading ids ≡ 0 .. TOPK/4 − 1
    (mod TOPK) in its chunk hold all the large logits, higher by work-item, so more than 4·TOPK keys reach the first
    scan's bound (the lowest of those work-items' fourth best) and the tiles run; "lane ties": the same without
    noise, four work-items to a value, so the tiles keep ties to the lower id."""
    logits = (rng.standard_normal(v) * 3).astype(np.float32)
    if kind == "ties":
        logits = np.full(v, 0.5, np.float32)
        logits[rng.integers(0, v, 300)] = 1.5
    elif kind == "masked":
        logits = np.full(v, -np.inf, np.float32)
        logits[rng.integers(0, v, 100)] = rng.standard_normal(100).astype(np.float32)
    elif kind in ("lanes", "lane ties"):
        topk, chunk = params["TOPK"], -(-v // params["GROUPS"])
        lane = (np.arange(v) % chunk) % topk
        share = lane < topk // 4
        step = lane[share] if kind == "lanes" else lane[share] // 4
        logits[share] = (0 if kind == "lane ties" else logits[share]) + 20 + 2 * step
    return logits


# (params, V, logits): each path of sample_partial. GROUPS 64 at V = 48: chunks of one logit and groups past the end;
# V = 16 379: chunks of 4·TOPK and fewer (the whole chunk sorted), and 1003: of 16; V = 16 448: chunks of 4·TOPK + 1
# (the bound, then the keys reaching it); "lanes" and "lane ties": the tiles, in chunks of 4096.
PARTIAL_CASES = [
    ({"TOPK": 64, "GROUPS": 64}, 48, "normal"),
    ({"TOPK": 64, "GROUPS": 64}, 16379, "normal"),
    ({"TOPK": 64, "GROUPS": 64}, 1003, "ties"),
    ({"TOPK": 64, "GROUPS": 64}, 16448, "normal"),
    ({"TOPK": 128, "GROUPS": 64}, 49157, "ties"),
    ({"TOPK": 64, "GROUPS": 64}, 49157, "masked"),
    ({"TOPK": 64, "GROUPS": 16}, 16 * 4096 - 3, "lanes"),
    ({"TOPK": 128, "GROUPS": 16}, 16 * 4096 - 3, "lanes"),
    ({"TOPK": 64, "GROUPS": 16}, 16 * 4096 - 3, "lane ties"),
    ({"TOPK": 128, "GROUPS": 16}, 16 * 4096 - 3, "lane ties"),
]


@pytest.mark.parametrize("params, v, kind", PARTIAL_CASES,
                         ids=[f"topk{p['TOPK']}-groups{p['GROUPS']}-v{v}-{k.replace(' ', '-')}"
                              for p, v, k in PARTIAL_CASES])
def test_each_group_keeps_its_best_keys_in_order(device, rng, params, v, kind):
    """sample_partial's output itself, exactly: each group's TOPK best keys of its chunk in descending order
    (ties to the lower id; empty keys past what it holds), its maximum y exactly, its Σ exp(y − max) within 1e-5
    (fp32 exp within a few ulp, summed over at most 64 terms a work-item and a tree of log2 TOPK: ~5e-6 at most).
    A history of 40 ids with a penalty of 2, exact in fp32, so the penalised path is checked too. Then draws at
    top_k = TOPK equal the reference's, which checks sample_final's merge of those keys."""
    topk, groups = params["TOPK"], params["GROUPS"]
    logits = _logits_of(kind, v, params, rng)
    history = rng.integers(0, v, 40).astype(np.int32)
    penalised = apply_repetition_penalty(logits, history, 2.0).astype(np.float32)
    sampler = Sample(device, params)
    for buffer, value in ((sampler.partial_keys, np.uint64(0x5A5A5A5A5A5A5A5A)), (sampler.partial_max, np.float32(7)),
                          (sampler.partial_sum, np.float32(-7))):
        device.fill(buffer, value)
    config = SamplingConfig(temperature=1.0, top_k=topk, top_p=1.0, min_p=0.0, repetition_penalty=2.0)
    _draws(device, sampler, logits, history, config, 5, [0])
    got_keys = device.read(np.empty(groups * topk, np.uint64), sampler.partial_keys).reshape(groups, topk)
    got_max = device.read(np.empty(groups, np.float32), sampler.partial_max)
    got_sum = device.read(np.empty(groups, np.float32), sampler.partial_sum)
    chunk = -(-v // groups)
    for g in range(groups):
        start, end = min(g * chunk, v), min((g + 1) * chunk, v)
        keys = np.sort(_keys(penalised[start:end], start))[::-1][:topk]
        want = np.zeros(topk, np.uint64)
        want[:len(keys)] = keys
        assert np.array_equal(got_keys[g], want), (g, np.nonzero(got_keys[g] != want)[0][:8])
        y = penalised[start:end].astype(np.float64)
        top = y.max() if end > start else -np.inf
        assert got_max[g] == top, (g, got_max[g], top)
        total = np.exp(y - top).sum() if np.isfinite(top) else 0.0
        assert abs(got_sum[g] - total) <= 1e-5 * total, (g, got_sum[g], total)
    probs = sampling_probs(penalised, 1.0, topk, 1.0, 0.0)
    cumulative = np.cumsum(np.sort(probs)[::-1][:np.count_nonzero(probs)])
    counters = [c for c in range(30) if np.min(np.abs(reference.sampling_uniform(5, c) - cumulative)) > MARGIN]
    got = _draws(device, sampler, logits, history, config, 5, counters)
    assert list(got) == [reference.draw_token(probs, reference.sampling_uniform(5, c)) for c in counters]
