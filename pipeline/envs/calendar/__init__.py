"""The booking calendar environment (registry name "calendar"): see :mod:`pipeline.envs.calendar.environment` and
docs/env-calendar.md. Modules: `world` (the generated rooms, people and bookings, and the held-out people), `tasks`
(families, wordings, plans and goals), `tools` (tool schemas, the world's checks and the write guard), `judge` (state-
based correctness), `expert` (scripted policies), `suites` (Great Expectations suites), `generate` (tasks of a weak
slice), `environment` (the environment and its episodes)."""

from pipeline.envs.calendar.environment import CalendarEpisode, CalendarOptions, CalendarWorld

__all__ = ["CalendarWorld", "CalendarEpisode", "CalendarOptions"]
