"""Phase `train`: DeepSpeed-distributed RL from the adapted policy.

Entry points: :mod:`~pipeline.train.main` (launches the ranks), :mod:`~pipeline.train.worker` (one rank: reads params
and data, runs the loop, writes metrics). The loop, :mod:`~pipeline.train.loop`, reads top to bottom (collect, score,
learn, watch, evaluate and keep, checkpoint) and calls:

- :mod:`~pipeline.train.sampling`: curriculum, goal sampler, reward normaliser, adaptive entropy coefficient, the
  update's task plan;
- :mod:`~pipeline.train.async_pool`: the asynchronous rollout threads;
- :mod:`~pipeline.train.guidance`: expert demonstrations for groups that all failed;
- :mod:`~pipeline.train.learner`: one update's optimisation, over :mod:`~pipeline.train.batch` (padded rows),
  :mod:`~pipeline.train.advantages` (scores to advantages, by the estimator `train.algorithm` names in the registry
  of :mod:`~pipeline.train.estimators`), :mod:`~pipeline.train.actor` (the model and its no-grad forwards) and
  :mod:`~pipeline.train.core_algos` (the pure tensor maths);
- :mod:`~pipeline.train.diagnostics`: rollout figures, tool usage, collapse alarms;
- :mod:`~pipeline.train.validation` and :mod:`~pipeline.train.early_stopping`: evaluate, keep the best, stop early;
- :mod:`~pipeline.train.checkpoint`: save and resume;
- :mod:`~pipeline.train.distributed`: ranks, DeepSpeed config and engine; :mod:`~pipeline.train.incoming`: incoming
  production tasks for the RL pool; :mod:`~pipeline.train.config`: the `train` section of params.yaml.

Every optional capability (tool-choice noise, adversarial sampling, generated tasks, the learned reward, the reward
weighting, event credit, replay, slicing; a population of runs) lives in :mod:`~pipeline.train.extensions`, one
module each, and joins the loop through the hooks of :class:`pipeline.train.extensions.base.Extension` (a
population trains the stage through its ``train_stage``).
"""
