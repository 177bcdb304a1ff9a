import math

import pytest
import torch

from wrappers.kl_controllers import AdaptiveKLController, ConstantKLController


def test_adaptive_controller_formula_on_known_numbers():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=100)
    for _ in range(10):
        coef = ctl.update([3.0, 3.0])
    assert isinstance(coef, float)
    assert coef == pytest.approx(0.1 * (1 - 0.2 / 100) ** 10) and round(coef, 3) == 0.098
    # above target: the error is clipped at +0.2; n_steps scales the step
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=100)
    assert ctl.update(torch.tensor([60.0]), n_steps=10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    # inside the clip range the error is proportional: KL 6.6 -> e = 0.1
    ctl = AdaptiveKLController(init_kl_coef=1.0, target=6.0, horizon=10)
    assert ctl.update(6.6) == pytest.approx(1.0 + 0.1 / 10)


def test_controllers_check_their_inputs():
    assert ConstantKLController(0.05).update([1.0, 2.0]) == 0.05
    with pytest.raises(ValueError, match="NaN"):
        AdaptiveKLController().update([1.0, math.nan])
    with pytest.raises(ValueError, match="> 0"):
        AdaptiveKLController(init_kl_coef=0.0)
    with pytest.raises(ValueError, match=">= 0"):
        ConstantKLController(-1.0)
    with pytest.raises(TypeError, match="KL values"):
        AdaptiveKLController().update("3")
