"""The shop world every phase acts in (the layer above `pipeline.core`; it imports nothing else of the library).

- :mod:`pipeline.env.world`: the generated SQLite world and document corpus, with the entity split.
- :mod:`pipeline.env.tools`: the tools (`lookup`, `calc`, `search`, `convert`, `update`, `answer`).
- :mod:`pipeline.env.protocol`: the action text format and its parser.
- :mod:`pipeline.env.tasks`: task families, levels, templates, plans and ground truth.
- :mod:`pipeline.env.taskfile`: the one writer and the one reader of task files (checked with the suite "tasks").
- :mod:`pipeline.env.reward`, :mod:`pipeline.env.verifier`: the composite reward and the rule verifier.
- :mod:`pipeline.env.prompt`: the one prompt every phase uses.
- :mod:`pipeline.env.core`: the Gymnasium environment, registered as ``agentrl/ToolTasks-v0``.
- :mod:`pipeline.env.expert`: the scripted expert, imperfect demonstrations and the random baseline.
- :mod:`pipeline.env.suites`, :mod:`pipeline.env.episode_suites`: the Great Expectations suites of this data (tasks,
  demonstrations, world tables, corpus, episodes), registered with :mod:`pipeline.core.validation`.
"""

import gymnasium

ENV_ID = "agentrl/ToolTasks-v0"

if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="pipeline.env.core:ToolTasksEnv")
