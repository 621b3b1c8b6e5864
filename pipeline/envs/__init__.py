"""Environments: the contract every environment keeps, the registry that finds them, and the pipeline's side of an
episode (the layer above `pipeline.core`).

- :mod:`pipeline.envs.contract`: the typed interface (tools with JSON Schemas, tasks, episodes, build and load);
- :mod:`pipeline.envs.registry`: find an environment by name, entry point or ``module:Class``; list them;
- :mod:`pipeline.envs.checks`: the checks run on any environment before it is trusted;
- :mod:`pipeline.envs.runner`: the Gymnasium environment ``agentrl/ToolTasks-v0`` over any environment: parsing,
  schema checks, invalid-call penalties, budgets, fault injection, reward and verifier;
- :mod:`pipeline.envs.mixed`: several environments as one, each task dispatched to its own;
- :mod:`pipeline.envs.protocol`, :mod:`pipeline.envs.prompt`: the action text format and the one prompt;
- :mod:`pipeline.envs.reward`, :mod:`pipeline.envs.verifier`: the composite reward and the rule verifier;
- :mod:`pipeline.envs.taskfile`: the one reader and writer of task files;
- :mod:`pipeline.envs.config`: the `env` section of params.yaml;
- built-in environments: :mod:`pipeline.envs.shop` and :mod:`pipeline.envs.sql`. Nothing outside them imports
  them: phases name an environment and the registry finds it.
"""
