"""Expert guidance of failed groups (`train.guide_failed_groups`; off-policy guidance as in LUFFY, Yan et al. 2025,
and ReLIFT, Ma et al. 2025): in a group whose rollouts all fail, the last rollout is replaced by the scripted
expert's episode of the same task and seed, so the group carries a signal.

The demonstration is recorded in the policy's token layout (:meth:`pipeline.policy.rollout.RolloutEngine.demonstrate`)
and marked ``demonstrated``; the learner gives its tokens importance weight 1. What the curriculum and the episode
metrics see (the policy's own outcomes) is the loop's business.
"""

from __future__ import annotations

from pipeline.envs.contract import TaskFields as Task


def guide_failed_groups(records: list[dict], tasks_by_id: dict[str, Task], engine,
                        version: int) -> tuple[list[dict], dict]:
    """A copy of `records` in which the last episode of every group whose episodes all failed is replaced by the
    scripted expert's episode of the same task and seed (as policy `version`). A demonstration the expert does not
    solve (an injected tool failure, say) is not used. Returns the records and counts: ``groups`` (groups seen),
    ``guided`` (replaced), ``expert_failed``."""
    out = list(records)
    members: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        members.setdefault(r["group"], []).append(i)
    counts = {"groups": len(members), "guided": 0, "expert_failed": 0}
    for idx in members.values():
        if any(records[i]["success"] for i in idx):
            continue
        last = records[idx[-1]]
        demo, = engine.demonstrate([tasks_by_id[last["task_id"]]], [last["seed"]], engine.runtime.expert, version)
        if not demo["success"]:
            counts["expert_failed"] += 1
            continue
        out[idx[-1]] = {**demo, "group": last["group"]}
        counts["guided"] += 1
    return out, counts


def guidance_metrics(counts: dict, dist) -> dict:
    """The counts of :func:`guide_failed_groups` summed over every rank, as logged metrics."""
    total = {k: sum(part[k] for part in dist.all_gather(counts)) for k in counts}
    return {"guidance/groups_guided": total["guided"],
            "guidance/group_share": total["guided"] / max(1, total["groups"]),
            "guidance/expert_failed": total["expert_failed"]}
