"""The tuner under a simulated noisy timer: heavy-tailed noise and occasional fast outliers, as on a phone
that throttles or a machine that is busy. It must pick the truly fastest candidate in a clear majority of
seeded runs, never crown a candidate for one lucky sample, set aside rounds during which the machine
drifted, and resume as before."""

from __future__ import annotations

import numpy as np
import pytest

from perfx.ops.params import ParamSpace
from perfx.timing import Timing
from perfx.tuning.database import Database
from perfx.tuning.spec import Case, Spec
from perfx.tuning.tuner import FULL_MIN, SCREEN_MARGIN, SCREEN_REPEAT, Tuner

pytestmark = pytest.mark.one_implementation   # a simulated timer: the device only holds the log

SHAPE = {"n": 1}
FASTEST = 5
TRUE_TIME = {x: 100e-6 * (1 + 0.08 * abs(x - FASTEST)) for x in range(8)}   # X = 0 (the default): 1.4x


class NoisyBench:
    """Kernels that are always right and whose times come from TRUE_TIME through a noisy timer."""

    def __init__(self, seed: int, lucky: int | None = None, outliers: float = 0.05, spread: float = 0.12):
        self.rng = np.random.default_rng(seed)
        self.current = None
        self.lucky, self.outliers, self.spread = lucky, outliers, spread
        self.lucky_calls = 2   # ``lucky``: this X's first timings (the probe and the search's) are 5x too fast

    def spec(self) -> Spec:
        space = ParamSpace(family="noisy", source="copy.cl", space={"X": tuple(range(8))})
        return Spec(params=space, make_case=self.make_case, tolerance=0.0, tolerance_why="always exact",
                    test_shapes=(SHAPE,), bytes_moved=lambda s: 1_000_000, reference=np.zeros_like,
                    fuzz_shapes=lambda st: st.just(SHAPE), oclgrind_shapes=(SHAPE,))

    def make_case(self, device, shape, rng) -> Case:
        def launch(params):
            self.current = params["X"]
            return []
        return Case(expected={"y": np.zeros(1)}, run=lambda params: {"y": np.zeros(1)}, launch=launch)

    def timer(self, launch, warmup=2, repeat=10, rotate=None, max_seconds=None) -> Timing:
        launch()
        x = self.current
        truth = TRUE_TIME[x]
        # Heavy tails: Student-t (3 degrees of freedom) in the log, about the 17-58% spreads seen on the
        # 2-core machines, and now and then a fast outlier at 0.3x.
        samples = truth * np.exp(self.spread * self.rng.standard_t(3, repeat))
        samples[self.rng.random(repeat) < self.outliers] = truth * 0.3
        if x == self.lucky and self.lucky_calls:
            samples[:] = truth * 0.2
            self.lucky_calls -= 1
        return Timing(float(np.median(samples)), [float(v) for v in samples])


def tune(device, tmp_path, bench: NoisyBench, seed: int, **kwargs):
    db = Database(tmp_path / f"user{seed}", tmp_path / "none")
    tuner = Tuner(device, db, seed=seed, timer=bench.timer, reference=lambda: 1e-3, cool_down_s=0, **kwargs)
    return tuner, tuner.tune_problem(bench.spec(), SHAPE)


def test_the_truly_fastest_wins_a_clear_majority_of_seeded_runs(device, tmp_path):
    results = [tune(device, tmp_path, NoisyBench(seed), seed)[1] for seed in range(20)]
    chosen = [r.chosen["X"] for r in results]
    assert chosen.count(FASTEST) >= 13, chosen                     # a clear majority
    for r in results:  # a challenger chosen is never far off; otherwise the incumbent (the defaults) stayed
        assert (TRUE_TIME[r.chosen["X"]] <= 1.08 * TRUE_TIME[FASTEST]
                or (r.chosen == {"X": 0} and r.confirmation.verdict != "replaced the incumbent")), chosen


def test_one_lucky_timing_never_crowns_a_slow_candidate(device, tmp_path):
    """X = 1 is 1.32x slower than the fastest, but its search timing comes out 5x too fast (a burst after
    throttling, as in the issue's 214 µs lone star): the search ranks it first, the confirmation does not."""
    for seed in range(5):
        bench = NoisyBench(seed, lucky=1)
        _, result = tune(device, tmp_path, bench, seed)
        assert result.best.params["X"] == 1, "the lucky timing did fool the search"
        assert result.chosen["X"] != 1, result.confirmation.verdict
        assert (TRUE_TIME[result.chosen["X"]] <= 1.08 * TRUE_TIME[FASTEST]
                or result.confirmation.verdict != "replaced the incumbent"), result.chosen
        assert result.time_s >= 0.8 * TRUE_TIME[result.chosen["X"]], "the recorded time is not a lucky one"


def test_no_significant_difference_keeps_the_incumbent(device, tmp_path):
    """Candidates of the same true time: whichever the search ranks first, the defaults stay, but for the few
    runs where the best of three challengers' 95% interval happens to lie below 1 (about 6 in 100 seeds of this
    timer, before and after the screening search alike)."""
    same = dict(TRUE_TIME)
    try:
        TRUE_TIME.update({x: 100e-6 for x in TRUE_TIME})
        results = [tune(device, tmp_path, NoisyBench(seed), seed)[1] for seed in range(10)]
    finally:
        TRUE_TIME.update(same)
    kept = [r for r in results if r.chosen == {"X": 0}]
    assert len(kept) >= 8, [r.confirmation.verdict for r in results]
    for r in kept:
        c = r.confirmation
        assert c.verdict != "replaced the incumbent"
        assert c.interval[0] <= 1.0 <= c.interval[1] or c.verdict == "the incumbent is fastest"


def test_drift_sets_rounds_aside_and_says_how_often(device, tmp_path):
    """The reference kernel slows for a while (throttling): those rounds are taken again after a cool-down."""
    slow = iter([False] * 12 + [True] * 3 + [False] * 1000)
    bench = NoisyBench(1)
    db = Database(tmp_path / "user", tmp_path / "none")
    tuner = Tuner(device, db, seed=1, timer=bench.timer, cool_down_s=0,
                  reference=lambda: 2e-3 if next(slow) else 1e-3)
    tuner.drift.every_s = 0   # the simulated timer takes no time: check at every candidate and round
    result = tuner.tune_problem(bench.spec(), SHAPE)
    assert tuner.drift.events == 3
    assert result.suspect_candidates + result.suspect_kept + result.confirmation.suspect_rounds == 3
    assert len(result.confirmation.rounds) == tuner.confirm_rounds
    # the fastest, or its neighbour 1.08x as slow: within this timer's noise (a spread of 12% a run)
    assert max(TRUE_TIME[result.best.params["X"]], TRUE_TIME[result.chosen["X"]]) <= 1.08 * TRUE_TIME[FASTEST]


def test_a_drifted_timing_is_taken_again_only_where_it_could_win(device, tmp_path):
    """Drift only slows a timing: one that, divided by the reference's slow-down, is still slower than the best
    so far is kept as it is; one that could be the best is taken again. The reference is 1.3x slow right after
    X = 3 (1.9x the fastest: 1.46x after the discount, slower than the defaults timed first) and X = 5 (the
    fastest) are timed."""
    same = dict(TRUE_TIME)
    try:
        TRUE_TIME[3] = 190e-6   # past 1.3x any best so far (100–140 us), within the 2x that cuts a set short
        bench = NoisyBench(4, outliers=0.0, spread=0.0)
        db = Database(tmp_path / "user", tmp_path / "none")
        tuner = Tuner(device, db, seed=4, timer=bench.timer, cool_down_s=0,
                      reference=lambda: 1.3e-3 if bench.current in (3, 5) else 1e-3)
        tuner.drift.every_s = 0
        result = tuner.tune_problem(bench.spec(), SHAPE)
    finally:
        TRUE_TIME.update(same)
    assert (result.suspect_kept, result.suspect_candidates) == (1, 1)
    slow = next(o for o in result.outcomes if o.params["X"] == 3)
    assert slow.status == "slow" and slow.time_s == pytest.approx(190e-6)   # cut at its screen, drift or not
    assert result.chosen["X"] == FASTEST


def test_a_confirmed_result_resumes_without_timing_anything(device, tmp_path):
    bench = NoisyBench(2)
    db = Database(tmp_path / "user", tmp_path / "none")
    first = Tuner(device, db, timer=bench.timer, reference=lambda: 1e-3, cool_down_s=0).tune_problem(
        bench.spec(), SHAPE)

    def no_timing(*args, **kwargs):
        raise AssertionError("a resumed, confirmed problem was timed again")

    again = Tuner(device, db, timer=no_timing, reference=lambda: 1e-3, cool_down_s=0).tune_problem(
        bench.spec(), SHAPE)
    assert again.chosen == first.chosen and again.confirmation.rounds == first.confirmation.rounds
    record = db.choices(device, bench.spec(), SHAPE)[0]
    assert record.source == "device" and record.params == first.chosen


@pytest.mark.parametrize("seed", range(3))
def test_bootstrap_interval_covers_the_true_ratio(seed):
    from perfx.timing import bootstrap_ratio
    rng = np.random.default_rng(seed)
    a = 1.2 * np.exp(0.1 * rng.standard_normal(9))
    b = np.exp(0.1 * rng.standard_normal(9))
    ratio, low, high = bootstrap_ratio(a, b, rng)
    assert low <= ratio <= high and low < 1.2 < high * 1.15


def test_the_screen_cuts_the_clearly_slower_and_times_the_rest_in_full(device, tmp_path):
    """Successive halving: every candidate is screened in SCREEN_REPEAT runs; one whose fastest run is beyond the
    runs' noise of the best so far goes no further, the rest are timed in full. The truly fastest is never cut."""
    bench = NoisyBench(7, outliers=0.0, spread=0.02)
    calls = []
    timer = bench.timer

    def counted(launch, **kwargs):
        timing = timer(launch, **kwargs)
        calls.append((bench.current, kwargs["repeat"]))
        return timing
    bench.timer = counted
    tuner, result = tune(device, tmp_path, bench, 7)
    assert tuner.noise.margin() == pytest.approx(SCREEN_MARGIN)   # 2% noise: the floor
    cut = [o for o in result.outcomes if o.status == "slow"]
    assert cut, "nothing was cut"
    for o in cut:
        x = o.params["X"]
        assert len(o.samples) == SCREEN_REPEAT and TRUE_TIME[x] > (1 + SCREEN_MARGIN) * TRUE_TIME[FASTEST]
        assert [n for c, n in calls if c == x] == [SCREEN_REPEAT], "a cut candidate timed past its screen"
    fastest = next(o for o in result.outcomes if o.params["X"] == FASTEST)
    assert fastest.status == "ok" and len(fastest.samples) >= FULL_MIN
    assert result.best.params["X"] == FASTEST and result.chosen["X"] == FASTEST


def test_a_noisier_machine_widens_the_screen(device, tmp_path):
    """The margin a screen allows is the runs' measured noise: on a noisy timer fewer candidates are cut, and
    what wins is still near the truly fastest."""
    quiet, _ = tune(device, tmp_path / "quiet", NoisyBench(8, outliers=0.0, spread=0.02), 8)
    noisy, result = tune(device, tmp_path / "noisy", NoisyBench(8, outliers=0.0, spread=0.25), 8)
    assert result.resumed == 0 and noisy.noise.margin() > 2 * quiet.noise.margin() > 0
    # 25% a run: 7 rounds of medians of 3 resolve two steps of 8%, not one
    assert TRUE_TIME[result.chosen["X"]] <= 1.17 * TRUE_TIME[FASTEST]


class Machine:
    """A simulated clock and reference kernel: ``level(t)`` is the reference's time at simulated second t, but
    for the readings numbered in ``spikes`` (from 1), 3x that; each reference timing takes that long four times
    over (a warm-up and three copies), and a sleep moves the clock on."""

    def __init__(self, level, spikes=()):
        self.now, self.level, self.readings, self.spikes = 0.0, level, 0, set(spikes)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def reference(self) -> float:
        self.readings += 1
        t = self.level(self.now) * (3 if self.readings in self.spikes else 1)
        self.now += 4 * t
        return t

    def watch(self, **kwargs):
        from perfx.tuning.tuner import DriftWatch
        return DriftWatch(self.reference, every_s=0.5, clock=self.clock, sleep=self.sleep, **kwargs)

    def checks(self, watch, count: int, gap_s: float = 0.6) -> list[bool]:
        """``count`` checks, one every ``gap_s`` seconds (the timings between them)."""
        said = []
        for _ in range(count):
            said.append(watch.drifted())
            self.now += gap_s
        return said


def test_the_baseline_follows_a_step_in_the_machines_level():
    """Another program starts and stays: the reference is 1.4x slower from then on. The first checks after the
    step say drift (a timing then is suspect), but once the new level fills most of the window it is the baseline,
    and checks at that level stop setting rounds aside. The quietest time ever seen would say drift for ever."""
    from perfx.tuning.tuner import DRIFT_QUANTILE, DRIFT_WINDOW
    machine = Machine(lambda t: 1e-3 if t < 20 else 1.4e-3)
    watch = machine.watch()
    while machine.now < 20:
        assert not machine.checks(watch, 1)[0]
    assert watch.baseline == pytest.approx(1e-3)
    after = machine.checks(watch, 2 * DRIFT_WINDOW)
    assert after[0], "the step itself is drift"
    flagged = sum(after)
    assert flagged <= DRIFT_WINDOW * (1 - DRIFT_QUANTILE) + 1, after
    assert not any(after[flagged:]) and watch.baseline == pytest.approx(1.4e-3)


def test_a_spike_is_drift_but_does_not_move_the_baseline():
    """One slow check among steady ones (a burst of another program) says drift, and the baseline stays."""
    machine = Machine(lambda t: 1e-3, spikes={20})
    watch = machine.watch()
    said = machine.checks(watch, 40)
    assert sum(said) == 1 and watch.events == 1 and watch.ratio == pytest.approx(3.0)
    assert watch.baseline == pytest.approx(1e-3)


def test_a_cool_down_ends_as_soon_as_the_reference_is_back():
    """After a spike the reference is timed at once: back within the threshold, the wait ends there, not after
    COOL_DOWN_S; the re-taken timing is checked again, whenever it is asked."""
    from perfx.tuning.tuner import COOL_DOWN_S
    machine = Machine(lambda t: 1e-3, spikes={20})
    watch = machine.watch()
    while not watch.drifted():
        machine.now += 0.6
    readings = machine.readings
    assert readings == 20
    waited = watch.cool_down(COOL_DOWN_S)
    assert machine.readings == readings + 1 and waited < 0.01
    assert not watch.drifted() and machine.readings == readings + 2   # checked although within every_s


def test_heat_is_waited_out_until_the_reference_is_back_and_no_longer():
    """A throttling spell: the reference is 2x slow for 1.2 s. The cool-down waits it out, polling, and ends
    within a poll of its end; a spell longer than COOL_DOWN_S is waited COOL_DOWN_S, then the round is re-taken."""
    from perfx.tuning.tuner import COOL_DOWN_POLL_S, COOL_DOWN_S
    machine = Machine(lambda t: 2e-3 if 10 <= t < 11.2 else 1e-3)
    watch = machine.watch()
    machine.checks(watch, 16)
    machine.now = 10.0
    assert watch.drifted()
    waited = watch.cool_down(COOL_DOWN_S)
    assert 11.2 <= machine.now <= 11.2 + COOL_DOWN_POLL_S + 0.02 and 1.1 < waited < COOL_DOWN_S

    hot = Machine(lambda t: 2e-3 if t >= 10 else 1e-3)
    watch = hot.watch()
    hot.checks(watch, 16)
    hot.now = 10.0
    assert watch.drifted()
    waited = watch.cool_down(COOL_DOWN_S)
    assert COOL_DOWN_S <= waited <= COOL_DOWN_S + 0.01 and watch.drifted(), "still hot: the re-taken round is suspect"


def test_transient_loads_do_not_cost_a_cool_down_each(device, tmp_path):
    """A sweep on a machine whose reference spikes now and then (another program's bursts) with the real
    COOL_DOWN_S: every spike sets its timing or round aside, and none waits for more than the one reference
    timing that finds it over. A fixed pause cost COOL_DOWN_S each."""
    from perfx.tuning.tuner import COOL_DOWN_S
    calls = {"n": 0}

    def reference():
        calls["n"] += 1
        return 3e-3 if calls["n"] % 4 == 0 else 1e-3
    bench = NoisyBench(3)
    db = Database(tmp_path / "user", tmp_path / "none")
    tuner = Tuner(device, db, seed=3, timer=bench.timer, reference=reference, cool_down_s=COOL_DOWN_S)
    tuner.drift.every_s = 0
    result = tuner.tune_problem(bench.spec(), SHAPE)
    assert tuner.drift.events >= 3
    assert result.confirmation.suspect_rounds + result.suspect_candidates >= 1
    assert tuner.drift.waited_s < 0.05 * tuner.drift.events
    assert tuner.report([result])["cooled_down_s"] == pytest.approx(tuner.drift.waited_s, abs=1e-3)
