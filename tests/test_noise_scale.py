"""The gradient-noise-scale estimator (metrics.NoiseScale) on a problem with a known covariance.

Per-example gradients g = G + eps, eps ~ N(0, Sigma) with a diagonal Sigma we choose, so the true
simple noise scale B_simple = tr(Sigma) / |G|^2 is known. Each step draws a global batch split over
8 replicas (the per-replica gradients the estimator would get from data parallelism) and feeds the
mean per-replica squared norm and the squared norm of the global mean.
"""

import numpy as np
import pytest

from parallax.train.metrics import NoiseScale, noise_scale_terms


@pytest.mark.parametrize("per_replica,true_scale", [(4, 100.0), (16, 30.0)])
def test_noise_scale_recovers_a_known_covariance(per_replica, true_scale):
    rng = np.random.default_rng(0)
    dim, replicas, steps = 256, 8, 400
    g = rng.normal(size=dim)
    variances = rng.uniform(0.5, 1.5, size=dim)
    g *= np.sqrt(variances.sum() / true_scale) / np.linalg.norm(g)  # |G|^2 = tr(Sigma) / true_scale
    tracker = NoiseScale(decay=0.98)
    b_small, b_big = per_replica, per_replica * replicas
    for _ in range(steps):
        grads = g + rng.normal(size=(b_big, dim)) * np.sqrt(variances)  # [B, dim] per-example gradients
        replica_means = grads.reshape(replicas, per_replica, dim).mean(axis=1)
        small = float(np.mean(np.sum(replica_means**2, axis=1)))
        big = float(np.sum(replica_means.mean(axis=0) ** 2))
        estimate = tracker.update(small, big, b_small, b_big)
    truth = variances.sum() / float(g @ g)
    assert truth == pytest.approx(true_scale)
    assert estimate == pytest.approx(truth, rel=0.20), (estimate, truth)


def test_noise_scale_terms_are_exact_on_expected_norms():
    g2, trace, b_small, b_big = 3.0, 120.0, 4, 32
    small, big = g2 + trace / b_small, g2 + trace / b_big  # the expectations themselves
    assert noise_scale_terms(small, big, b_small, b_big) == pytest.approx((g2, trace))
    with pytest.raises(ValueError):
        noise_scale_terms(small, big, 8, 8)
