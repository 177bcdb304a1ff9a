"""Reference models and KL penalties: one home per concept.

- Estimators and shaping (:mod:`wrappers.kl.estimators`): :func:`kl_estimate` (k1, k2, k3) and
  :func:`shape_token_rewards`, the one implementation of per-token KL shaping every piece below uses.
- Coefficients (:mod:`wrappers.kl.controllers`): :class:`ConstantKLController`, :class:`AdaptiveKLController`, and
  the one home of the controller arguments every piece takes (``kl=``: a number or a controller) and of the atomic
  read-and-update a controller shared by envs on threads needs.
- Reference models: :class:`ReferenceModel` (local transformers model; a sequence that extends one it scored
  before costs a forward over the new tokens only, :mod:`wrappers.kl.incremental`), :class:`RayRefModel` (in a
  Ray actor).
- Env wrappers (:mod:`wrappers.kl.env`, :mod:`wrappers.kl.vector`): :class:`RefLogProbs`, :class:`KLPenalty`, and
  :class:`VectorRefLogProbs` (one batched reference forward per vector step).
- TensorDict transforms (:mod:`wrappers.kl.transforms`): :class:`RetrieveLogProb`, :class:`KLComputation`,
  :class:`RetrieveKL`, :class:`KLRewardTransform`.
"""

from wrappers.kl.controllers import AdaptiveKLController, ConstantKLController, KLController
from wrappers.kl.env import KLPenalty, RefLogProbs
from wrappers.kl.estimators import KL_ESTIMATORS, kl_estimate, shape_token_rewards
from wrappers.kl.ray import RayRefModel, RefModelUnavailable
from wrappers.kl.reference import ReferenceModel
from wrappers.kl.transforms import KLComputation, KLRewardTransform, RetrieveKL, RetrieveLogProb
from wrappers.kl.vector import VectorRefLogProbs

__all__ = [
    # estimators and shaping
    "KL_ESTIMATORS",
    "kl_estimate",
    "shape_token_rewards",
    # coefficients
    "AdaptiveKLController",
    "ConstantKLController",
    "KLController",
    # reference models
    "RayRefModel",
    "RefModelUnavailable",
    "ReferenceModel",
    # env wrappers
    "KLPenalty",
    "RefLogProbs",
    "VectorRefLogProbs",
    # transforms
    "KLComputation",
    "KLRewardTransform",
    "RetrieveKL",
    "RetrieveLogProb",
]
