"""The buffer service: dockyard's replay buffer of whole GRPO groups.

    collector --PutGroup/PutGroupStream--> [held] --SampleGroupsStream--> [pending] --AckGroups--> [acked: id only]
                                            |
                                            +-- aged out at sampling --> [dropped_stale: id only, counted]
    (on Redis, payloads go around the service: staged by the collector, read by the trainer; GetDataPlane)

    servicer.py        BufferServicer: protobuf <-> backend calls; sizes, GetDataPlane
    validation.py      the checks of what a put carries (a group the trainer can train on)
    backend.py         BufferBackend: the semantics every backend keeps; memory.py, redis_backend.py
    redis_scripts.py   the Redis backend's Lua scripts, one per method

Guarantees, per job:
- a group is stored, leased, acked and dropped whole, never in part;
- puts are idempotent by group id: a retried put changes nothing and says so;
- no group is returned by two samples, and none disappears uncounted: every accepted
  group is held, pending, acked or dropped as stale;
- every group a sample returns satisfies trainer_step - weight_version <= max_trajectory_age_steps;
- held plus pending never exceeds `max_groups`; a put beyond it is refused, not silently dropped.

Semantics every backend keeps: `backend.BufferBackend`; the page: docs/buffer.md.
"""
