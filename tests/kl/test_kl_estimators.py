"""kl_estimate and shape_token_rewards against independent computations (plain Python loops, exact KL)."""

import importlib
import math

import pytest
import torch

from wrappers.kl import kl_estimate, shape_token_rewards


def shaped_by_hand(kl, task, coef, mask):
    """Row by row with Python floats: -coef*kl where counted, 0 elsewhere, task on the last counted (else last)."""
    out = []
    for row_kl, row_task, row_mask in zip(kl, task, mask):
        row = [-coef * k if m else 0.0 for k, m in zip(row_kl, row_mask)]
        counted = [t for t, m in enumerate(row_mask) if m]
        row[counted[-1] if counted else len(row) - 1] += row_task
        out.append(row)
    return out


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_against_their_formulas(estimator):
    log_p = [-0.1, -2.5, -0.7, -4.0]
    log_q = [-0.3, -1.0, -0.7, -6.5]
    formulas = {
        "k1": lambda p, q: p - q,
        "k2": lambda p, q: 0.5 * (p - q) ** 2,
        "k3": lambda p, q: math.exp(q - p) - 1 - (q - p),
    }
    got = kl_estimate(torch.tensor(log_p, dtype=torch.float64), torch.tensor(log_q, dtype=torch.float64), estimator)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx([formulas[estimator](p, q) for p, q in zip(log_p, log_q)], rel=1e-12)
    assert kl_estimate(torch.tensor(log_p), torch.tensor(log_q), estimator).dtype == torch.float32


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    # exact KL(p || q) of two categoricals vs the mean estimate over tokens sampled from p
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    exact = sum(float(pi) * math.log(float(pi) / float(qi)) for pi, qi in zip(p, q))
    samples = torch.multinomial(p, 400_000, replacement=True, generator=torch.Generator().manual_seed(0))
    log_p, log_q = p.log()[samples], q.log()[samples]
    assert float(kl_estimate(log_p, log_q, "k1").mean()) == pytest.approx(exact, abs=5e-3)
    k3 = kl_estimate(log_p, log_q, "k3")
    assert float(k3.mean()) == pytest.approx(exact, abs=5e-3) and bool((k3 >= 0).all())
    assert bool((kl_estimate(log_p, log_q, "k2") >= 0).all())


def test_estimator_errors():
    with pytest.raises(ValueError, match="estimator must be one of 'k1', 'k2', 'k3', got 'k4'; did you mean"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(ValueError, match=r"same shape, got \(2,\) and \(3,\)"):
        kl_estimate(torch.zeros(2), torch.zeros(3))


def test_shaping_one_turn_by_hand():
    # kl (0.5, -0.2, 1.0), coef 0.1, task 2: (-0.05, 0.02, -0.1 + 2)
    got = shape_token_rewards(torch.tensor([0.5, -0.2, 1.0], dtype=torch.float64), 2.0, 0.1)
    assert got.tolist() == pytest.approx([-0.05, 0.02, 1.9], rel=1e-12)
    # masked positions get 0 whatever their kl (NaN too); the task reward goes on the last counted token
    kl = torch.tensor([[math.nan, 0.5, 0.25, math.nan]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True, False]])
    assert shape_token_rewards(kl, torch.tensor([[1.0]]), 0.2, mask).tolist() == [[0.0, -0.1, 1.0 - 0.05, 0.0]]
    # no counted position: the task reward is not lost, it lands on the last position
    assert shape_token_rewards(torch.zeros(1, 3), 1.5, 0.1, torch.zeros(1, 3, dtype=torch.bool)).tolist() == [
        [0.0, 0.0, 1.5]
    ]
    # zero coefficient: only the task reward
    assert shape_token_rewards(torch.tensor([3.0, 4.0]), -1.0, 0.0).tolist() == [0.0, -1.0]


@pytest.mark.parametrize("seed", range(5))
def test_shaping_random_batches_against_loops(seed):
    gen = torch.Generator().manual_seed(seed)
    b, t = 4, 9
    kl = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, t, generator=gen) < 0.6
    mask[seed % b] = False  # one row counts nothing
    kl[~mask] = math.nan  # never read
    task = torch.randn(b, generator=gen, dtype=torch.float64)
    coef = float(torch.rand(1, generator=gen))
    got = shape_token_rewards(kl, task, coef, mask)
    expected = shaped_by_hand(kl.tolist(), task.tolist(), coef, mask.tolist())
    for row, exp in zip(got.tolist(), expected):
        assert row == pytest.approx(exp, rel=1e-12, abs=1e-15)
    assert not torch.isnan(got).any()
    # the row sums: task - coef * sum of counted kl
    sums = task - coef * torch.where(mask, kl, torch.zeros_like(kl)).sum(-1)
    assert torch.allclose(got.sum(-1), sums, atol=1e-12)
    assert shape_token_rewards(kl.float(), task, coef, mask).dtype == torch.float32


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((torch.zeros(3), 1.0, -0.1), ValueError, "coef must be a finite number >= 0, got -0.1"),
        ((torch.zeros(3), 1.0, math.nan), ValueError, "coef must be a finite number >= 0, got nan"),
        ((torch.zeros(3), 1.0, math.inf), ValueError, "coef must be a finite number >= 0, got inf"),
        ((torch.zeros(3), 1.0, "0.1"), TypeError, "coef must be a number, got str"),
        ((torch.zeros(3), math.nan, 0.1), ValueError, "task_reward must be finite, got nan"),
        (
            (torch.zeros(2, 3), torch.tensor([1.0, math.inf]), 0.1),
            ValueError,
            "task_reward must be finite, got inf at row 1",
        ),
        ((torch.tensor([0.0, math.nan]), 1.0, 0.1), ValueError, r"kl is not finite on a counted position \(1,\)"),
        ((torch.zeros(2, 3), torch.zeros(3), 0.1), ValueError, r"task_reward must be a number or of shape \(2,\)"),
        ((torch.tensor(1.0), 1.0, 0.1), ValueError, "token dimension"),
    ],
)
def test_shaping_refuses_bad_inputs(args, error, message):
    with pytest.raises(error, match=message):
        shape_token_rewards(*args)


def test_shaping_mask_shape_must_match():
    with pytest.raises(ValueError, match=r"mask must have the shape of kl \(3,\), got \(2,\)"):
        shape_token_rewards(torch.zeros(3), 1.0, 0.1, mask=torch.ones(2, dtype=torch.bool))


def test_one_home_per_concept():
    for old in ("wrappers.transforms", "wrappers.kl_controllers", "wrappers.ray_ref"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
