"""Phase `reward_model`: a learned verifier beside the rule verifier (docs/design.md §3.1.2, §3.6.2).

:mod:`~pipeline.reward_model.features` turns a trajectory into hashed features, :mod:`~pipeline.reward_model.model`
is the model (two logistic heads: success and process soundness) with its metrics, :mod:`~pipeline.reward_model.main`
is the stage, :mod:`~pipeline.reward_model.reward` applies the model as a reward component in `train`, and
:mod:`~pipeline.reward_model.guard` is the reward-hacking alarm.
"""
