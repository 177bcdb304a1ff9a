"""KL controllers on numbers computed by hand (Ziegler et al.: e = clip(KL/target - 1, ±0.2), coef *= 1 + e·n/H)."""

import math

import numpy as np
import pytest
import torch

from wrappers.kl import AdaptiveKLController, ConstantKLController, KLComputation


def test_n_steps_defaults_to_the_number_of_values():
    # ten values of 3.0 against target 6: e = 3/6 - 1 = -0.5, clipped to -0.2; n_steps = 10 by default
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    coef = ctl.update([3.0] * 10)
    assert isinstance(coef, float)
    assert coef == pytest.approx(0.09998, rel=1e-12)  # 0.1 * (1 - 0.2 * 10 / 10000) = 0.1 * 0.9998
    assert ctl.coef == coef
    # the same values with n_steps=1 move it ten times less
    assert AdaptiveKLController(0.1, 6.0, 10000).update([3.0] * 10, n_steps=1) == pytest.approx(0.099998, rel=1e-12)


def test_adaptive_controller_formula_on_known_numbers():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=100)
    for _ in range(10):
        coef = ctl.update([3.0, 3.0])  # n_steps = 2: factor 1 - 0.2 * 2 / 100 = 0.996 each time
    assert coef == pytest.approx(0.1 * 0.996**10, rel=1e-12) and round(coef, 4) == 0.0961
    # above target: the error is clipped at +0.2; n_steps scales the step
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=100)
    assert ctl.update(torch.tensor([60.0]), n_steps=10) == pytest.approx(0.102, rel=1e-12)  # 0.1 * (1 + 0.02)
    # inside the clip range the error is proportional: KL 6.6 -> e = 0.1
    ctl = AdaptiveKLController(init_kl_coef=1.0, target=6.0, horizon=10)
    assert ctl.update(6.6) == pytest.approx(1.01, rel=1e-12)
    # the mean of the values is the KL: mean(5.4, 6.0) = 5.7 -> e = -0.05; factor 1 - 0.05 * 2 / 10 = 0.99
    ctl = AdaptiveKLController(init_kl_coef=0.5, target=6.0, horizon=10)
    assert ctl.update(np.array([5.4, 6.0])) == pytest.approx(0.495, rel=1e-12)
    # on target, or no steps: unchanged; no values: refused (the mean KL of nothing is undefined)
    assert AdaptiveKLController(0.3, 6.0, 10).update([0.0, 12.0]) == 0.3
    assert AdaptiveKLController(0.3, 6.0, 10).update([1.0], n_steps=0) == 0.3
    with pytest.raises(ValueError, match="expected at least one observed KL value, got none"):
        AdaptiveKLController(0.3, 6.0, 10).update([])


def test_adaptive_coefficient_never_becomes_negative():
    # factor 1 - 0.2 * 100 / 10 = -1: clipped at 0, never below
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10)
    assert ctl.update([0.0], n_steps=100) == 0.0
    assert ctl.update([0.0], n_steps=100) == 0.0 and ctl.update([60.0], n_steps=5) == 0.0
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10)
    assert ctl.update([0.0], n_steps=50) == 0.0  # exactly 1 - 0.2 * 5 = 0


def test_controllers_check_their_inputs():
    assert ConstantKLController(0.05).update([1.0, 2.0]) == 0.05
    assert ConstantKLController(0.0).coef == 0.0
    with pytest.raises(ValueError, match="NaN"):
        AdaptiveKLController().update([1.0, math.nan])
    with pytest.raises(ValueError, match="finite"):
        AdaptiveKLController().update([math.inf])
    with pytest.raises(ValueError, match="finite"):
        ConstantKLController(0.1).update([math.nan])
    with pytest.raises(ValueError, match="init_kl_coef must be a finite number > 0, got 0.0"):
        AdaptiveKLController(init_kl_coef=0.0)
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0, got -1.0"):
        ConstantKLController(-1.0)
    with pytest.raises(TypeError, match="KL values"):
        AdaptiveKLController().update("3")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        # one bound, stated the same way whatever the bad value (a negative value was told ">= 0" before)
        ({"init_kl_coef": math.nan}, "init_kl_coef must be a finite number > 0, got nan"),
        ({"init_kl_coef": -0.1}, "init_kl_coef must be a finite number > 0, got -0.1"),
        ({"target": math.nan}, "target must be a finite number > 0, got nan"),
        ({"target": 0.0}, "target must be a finite number > 0, got 0.0"),
        ({"target": -1}, "target must be a finite number > 0, got -1"),
        ({"target": math.inf}, "target must be a finite number > 0, got inf"),
        ({"horizon": 0}, "horizon must be a finite number > 0, got 0"),
        ({"horizon": -5}, "horizon must be a finite number > 0, got -5"),
    ],
)
def test_adaptive_controller_refuses_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdaptiveKLController(**kwargs)


@pytest.mark.parametrize("ctl", [AdaptiveKLController(0.1, 6.0, 10), ConstantKLController(0.1)])
def test_n_steps_is_checked(ctl):
    with pytest.raises(ValueError, match="n_steps must be >= 0, got -1"):
        ctl.update([1.0], n_steps=-1)
    with pytest.raises(TypeError, match="n_steps must be an int, got float"):
        ctl.update([1.0], n_steps=1.5)
    with pytest.raises(TypeError, match="n_steps must be an int, got bool"):
        ctl.update([1.0], n_steps=True)
    assert ctl.coef == 0.1  # refused updates change nothing
    assert ctl.update([6.0], n_steps=np.int64(3)) == pytest.approx(0.1)


def test_constant_coefficients_refused_where_they_are_given():
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0, got nan"):
        ConstantKLController(math.nan)
    with pytest.raises(ValueError, match="kl must be a finite number >= 0, got -0.1"):
        KLComputation(-0.1)
    with pytest.raises(ValueError, match="kl must be a finite number >= 0, got inf"):
        KLComputation(math.inf)
    with pytest.raises(TypeError, match="kl must be a number, got str"):
        KLComputation("0.1")
    assert KLComputation(AdaptiveKLController(0.2)).kl.coef == 0.2  # a controller is read at each call
