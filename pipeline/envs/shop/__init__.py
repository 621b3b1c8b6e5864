"""The shop world: a built-in environment of the pipeline (``env.name: shop``, the default).

A generated SQLite shop (products, suppliers) with a document corpus, and tasks in seven families at four levels that
need its tools: `lookup`, `calc`, `search`, `convert`, `update` (the one write, allowed only where the task permits it)
and `answer`.

- :mod:`~pipeline.envs.shop.world`: the generated world and the entity split;
- :mod:`~pipeline.envs.shop.tools`: the tools;
- :mod:`~pipeline.envs.shop.tasks`: task families, levels, templates, plans and ground truth;
- :mod:`~pipeline.envs.shop.expert`: the scripted expert, imperfect demonstrations and the random baseline;
- :mod:`~pipeline.envs.shop.requests`: serving requests;
- :mod:`~pipeline.envs.shop.suites`, :mod:`~pipeline.envs.shop.episode_suites`, :mod:`~pipeline.envs.shop.validate`:
  its Great Expectations suites and the checks `build_env` runs with them;
- :mod:`~pipeline.envs.shop.environment`: :class:`ShopWorld`, the shop as an implementation of the contract
  (:mod:`pipeline.envs.contract`). Phases reach it only through the registry, never by import.
"""

from pipeline.envs.shop.environment import ShopWorld

__all__ = ["ShopWorld"]
