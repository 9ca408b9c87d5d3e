"""Pure math: multipliers, gamma, softmax weights and the controller update, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hdet_track.controller import controller_update, softmax_weights
from hdet_track.schedule import decay_gamma, draw_permutation, multipliers, permutation_generator


def test_multipliers_hand_computed():
    assert multipliers(4, 0.3) == pytest.approx([0.7, 0.9, 1.1, 1.3])
    assert multipliers(2, 0.5) == [0.5, 1.5]
    assert multipliers(3, 0.2) == pytest.approx([0.8, 1.0, 1.2])
    assert multipliers(1, 0.5) == [1.0]
    assert multipliers(5, 0.0) == [1.0] * 5


@pytest.mark.parametrize("n", [2, 3, 4, 7, 8, 16])
@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.9])
def test_multipliers_symmetric_mean_one_and_in_range(n, alpha):
    rho = multipliers(n, alpha)
    assert math.fsum(rho) / n == pytest.approx(1.0, abs=1e-15)
    assert rho[0] == pytest.approx(1 - alpha) and rho[-1] == pytest.approx(1 + alpha)
    assert all(a < b for a, b in zip(rho, rho[1:]))
    assert all(r + s == pytest.approx(2.0) for r, s in zip(rho, reversed(rho)))


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), "0.2", True])
def test_multipliers_reject_bad_spread(bad):
    with pytest.raises(ValueError, match=r"spread in \[0, 1\)"):
        multipliers(4, bad)


def test_gamma_decays_by_div_over_final_div():
    g = decay_gamma(25.0, 1e4, 10)
    assert g == pytest.approx(1 - 0.0025**0.1)
    assert 0 < g < 1
    assert (1 - g) ** 10 == pytest.approx(25.0 / 1e4)
    # The paper's printed sign would give (1e4 / 25) ** (1 / K) ~ 1.82 here: growth. Never here.
    assert 1 - g < 1
    assert decay_gamma(25.0, 1e4, 0) == 0.0
    assert decay_gamma(25.0, 10.0, 5) == 0.0  # ratio >= 1: no decay, never growth


def test_softmax_weights_hand_computed():
    # losses 1 and 1 + 0.1 ln 3 at temperature 0.1: scores +-ln(3)/2, weights 3/4 and 1/4.
    w = softmax_weights([1.0, 1.0 + 0.1 * math.log(3)], 0.1)
    assert w == pytest.approx([0.75, 0.25])
    assert softmax_weights([2.0, 2.0, 2.0], 0.5) == pytest.approx([1 / 3] * 3)
    # Huge loss gaps stay finite (max subtraction).
    w = softmax_weights([0.0, 1e6], 1e-3)
    assert w == [1.0, 0.0]
    with pytest.raises(ValueError, match="temperature"):
        softmax_weights([1.0], 0.0)


def test_controller_update_hand_computed():
    # values 0.5, 1.5 with weights 3/4, 1/4: weighted mean 0.75, mean 1.0, delta -0.25;
    # velocity 0.9 * 0 + 0.1 * -0.25 = -0.025; base 1.0 * 0.9 + 0.5 * -0.025 = 0.8875.
    u = controller_update(
        [0.5, 1.5], [0.75, 0.25], 1.0, 0.0, meta_lr=0.5, meta_momentum=0.9, gamma=0.1, bounds=(0.0, 10.0)
    )
    assert u.delta == pytest.approx(-0.25)
    assert u.velocity == pytest.approx(-0.025)
    assert u.base_after == pytest.approx(0.8875)
    assert u.base_before == 1.0 and not u.clipped
    # Momentum carries the previous velocity: 0.9 * 0.2 + 0.1 * 0.25 = 0.205.
    u = controller_update(
        [0.5, 1.5], [0.25, 0.75], 1.0, 0.2, meta_lr=1.0, meta_momentum=0.9, gamma=0.0, bounds=(0.0, 10.0)
    )
    assert u.velocity == pytest.approx(0.205) and u.base_after == pytest.approx(1.205)


def test_controller_update_is_clipped_to_bounds():
    u = controller_update(
        [0.1, 1.9], [1.0, 0.0], 0.1, -5.0, meta_lr=1.0, meta_momentum=0.5, gamma=0.0, bounds=(0.01, 10.0)
    )
    assert u.base_after == 0.01 and u.clipped  # unbounded it would be negative
    u = controller_update(
        [0.1, 1.9], [0.0, 1.0], 9.0, 5.0, meta_lr=1.0, meta_momentum=0.5, gamma=0.0, bounds=(0.01, 10.0)
    )
    assert u.base_after == 10.0 and u.clipped


def test_permutation_streams_are_private_and_reproducible():
    state = torch.get_rng_state()
    a = [draw_permutation(8, g) for g in [permutation_generator(5, 0)] * 3]
    b = [draw_permutation(8, g) for g in [permutation_generator(5, 0)] * 3]
    c = [draw_permutation(8, g) for g in [permutation_generator(5, 1)] * 3]
    assert a == b and a != c
    assert all(sorted(p) == list(range(8)) for p in a)
    assert torch.equal(state, torch.get_rng_state())
