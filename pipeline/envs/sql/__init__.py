"""The read-only SQL analyst environment (registry name "sql"): see :mod:`pipeline.envs.sql.analyst` and
docs/env-sql.md. Modules: `world` (the generated database and held-out partition), `tasks` (families, wordings,
reference SQL), `tools` (tool schemas and the guarded query runner), `expert` (scripted policies), `suites` (Great
Expectations suites of the tables), `analyst` (the environment and its episodes)."""

from pipeline.envs.sql.analyst import SqlAnalyst, SqlEpisode, SqlOptions, answers_match

__all__ = ["SqlAnalyst", "SqlEpisode", "SqlOptions", "answers_match"]
