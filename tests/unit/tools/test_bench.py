"""``ddpkit bench``: the model's pure logic against hand-worked cases, and bad input refused before
any rank starts."""

import pytest

from ddpkit._errors import ConfigError
from ddpkit.tools import _predict as predict
from ddpkit.tools._bench import BenchConfig
from ddpkit.tools._measure import DEFAULT_SIZES
from ddpkit.tools._workload import load_workload


def test_alpha_beta_fit_recovers_a_known_line():
    alpha, beta = 50e-6, 2e9
    points = [(b, alpha + b / beta) for b in DEFAULT_SIZES]
    fit = predict.fit_alpha_beta(3, points)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    assert fit.beta_bytes_per_s == pytest.approx(beta, rel=1e-6)
    assert fit.bus_bandwidth == pytest.approx(beta * 4 / 3)  # nccl-tests: busbw = algbw x 2(n-1)/n
    assert fit.hop_latency_s == pytest.approx(alpha / 4)  # a ring at 3 ranks takes 2(n-1) = 4 steps


def test_the_measured_time_at_a_bucket_size_is_the_measurement_not_the_fit():
    # Measured at 8 ranks on 2 cores here: flat from 64 B to 1 MiB (the scheduler), steep at 16 MiB.
    points = [(4, 2.9e-3), (64, 16.0e-3), (1024, 18.7e-3), (16384, 16.6e-3), (65536, 20.3e-3)]
    points += [(1 << 20, 19.8e-3), (1 << 24, 64.9e-3)]
    fit = predict.fit_alpha_beta(8, points)
    assert fit.measured_seconds(65536) == 20.3e-3  # a size measured: its own time
    # half-way in log size: the geometric mean of the neighbours
    between = fit.measured_seconds(32768)
    assert between == pytest.approx((16.6e-3 * 20.3e-3) ** 0.5)
    # beyond the sizes measured: the fit
    assert fit.measured_seconds(1 << 26) == fit.seconds(1 << 26)
    # Control: the fit's line puts a 58 KB bucket well under what was measured around it.
    assert fit.seconds(58536) < 0.8 * fit.measured_seconds(58536)


def test_ring_model_and_buckets():
    link = predict.Interconnect("x", busbw_bytes_per_s=1e9, hop_latency_s=1e-6)
    assert predict.ring_seconds(1e6, 1, link) == 0.0
    assert predict.ring_seconds(1e6, 4, link) == pytest.approx(6e-6 + 1.5 * 1e6 / 1e9)
    mib = predict.MIB
    # reverse order; the first bucket closes at 1 MiB, the next ones at the cap
    assert predict.bucket_sizes([mib // 2] * 6, bucket_cap_mb=1.5) == [
        mib,
        int(1.5 * mib),
        mib // 2,
    ]
    # too big for any bucket: its own
    assert predict.bucket_sizes([4 * mib], bucket_cap_mb=1) == [4 * mib]
    fast, slow = predict.PRESETS["nvlink"], predict.PRESETS["ethernet"]
    assert predict.link_for(8, 8, fast, slow) == (fast, 1)
    ring, nodes = predict.link_for(9, 8, fast, slow)  # across nodes: the slower link's pace
    assert nodes == 2 and ring.busbw_bytes_per_s == slow.busbw_bytes_per_s
    assert ring.hop_latency_s == slow.hop_latency_s


def test_overlap_hides_early_buckets_and_not_the_last():
    per_byte = lambda b: b * 1e-3  # noqa: E731
    # two equal buckets, backward 10 s: the first is ready at 5 s and done at 5 + 2; the second at
    # 10 + 2.
    assert predict.exposed_seconds([2000, 2000], 10.0, per_byte) == pytest.approx(2.0)
    # control: without overlap both all-reduces count in full
    assert predict.exposed_seconds([2000, 2000], 10.0, per_byte, overlap=False) == pytest.approx(
        4.0
    )
    # communication slower than backward: it queues, and all that outlasts backward is exposed
    assert predict.exposed_seconds([2000, 2000], 1.0, lambda b: 3.0) == pytest.approx(
        0.5 + 6.0 - 1.0
    )


def test_bad_options_name_the_flag():
    with pytest.raises(ConfigError, match="--interconnect"):
        BenchConfig(interconnect="carrier pigeon")
    with pytest.raises(ConfigError, match="--nproc 1"):
        BenchConfig(nproc=1)
    with pytest.raises(ConfigError, match="--bandwidth"):
        BenchConfig(bandwidth_gbps=0)


def test_a_script_without_the_hook_is_refused(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="ddpkit_workload"):
        load_workload(str(script))


def test_stragglers_cost_nothing_without_jitter_and_grow_with_ranks():
    assert predict.straggler_seconds([2e-3] * 60, 8) == 0.0
    jittery = [1e-3] * 50 + [5e-3] * 10  # one step in six is slow
    two, eight = predict.straggler_seconds(jittery, 2), predict.straggler_seconds(jittery, 8)
    assert 0.0 <= two < eight <= 4e-3 + 1e-12


def _one_rank_on_the_cpu(step_s: float) -> dict:
    parts = {
        "data": 0.1e-3,
        "forward": 0.5e-3,
        "backward": 1.0e-3,
        "backward_no_sync": 0.8e-3,
        "optimizer": 0.2e-3,
    }
    one = {
        "parts": parts | {"step": 2.0e-3},
        "device": "cpu",
        "param_bytes": [4000],
        "batch_size": 8,
    }
    return {1: one | {"step_samples": [2.0e-3] * 5}, 2: {"parts": {"step": step_s}}}


def test_on_the_cpu_the_prediction_takes_the_all_reduce_as_a_step_meets_it():
    from ddpkit.tools._predict import compute_seconds, predictions

    scaling = _one_rank_on_the_cpu(step_s=3.0e-3)
    fits = {2: predict.fit_alpha_beta(2, [(4, 1e-4), (4000, 2e-4), (1 << 24, 1e-2)])}
    one_rank = {4000: 0.05e-3}  # of the 1-rank wait of 0.2 ms: 0.15 ms is DDP's fixed cost
    assert compute_seconds(scaling) == pytest.approx(1.8e-3)
    (row,) = predictions(BenchConfig(nproc=2), scaling, fits, one_rank, {2: 0.7e-3})["this_machine"]
    # DDP's fixed cost + the in-step all-reduce
    assert row["exposed_comm_s"] == pytest.approx(0.15e-3 + 0.7e-3)
    # no straggler: every sample alike
    assert row["step_s"] == pytest.approx(1.8e-3 + 0.15e-3 + 0.7e-3)
    assert row["allreduce_in_step_s"] == 0.7e-3
    # Control: without the in-step measurement, the bucket's time measured alone (back to back).
    (alone,) = predictions(BenchConfig(nproc=2), scaling, fits, one_rank)["this_machine"]
    assert alone["exposed_comm_s"] == pytest.approx(0.15e-3 + 2e-4)
