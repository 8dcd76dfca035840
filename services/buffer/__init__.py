"""The buffer service: dockyard's replay buffer of whole GRPO groups.

    collector --PutGroup--> [held] --SampleGroups--> [pending] --AckGroups--> [acked: id only]
                               |
                               +-- aged out at sampling --> [dropped_stale: id only, counted]

Guarantees, per job:
- a group is stored, leased, acked and dropped whole, never in part;
- puts are idempotent by group id: a retried put changes nothing and says so;
- no group is returned by two samples, and none disappears uncounted: every accepted
  group is held, pending, acked or dropped as stale;
- every group a sample returns satisfies trainer_step - weight_version <= max_trajectory_age_steps;
- held plus pending never exceeds `max_groups`; a put beyond it is refused, not silently dropped.

Semantics every backend keeps: `backend.BufferBackend`; the page: docs/buffer.md.
"""
