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
- the clock (`latest_version`) moves forward only by the job's trainer: AckGroups, and a sample or
  reclaim above the clock (one step at most), must carry the lease TakeTrainerLease last issued (any
  other caller is FAILED_PRECONDITION, nothing changes); an ack of no groups, or of none still leased,
  never moves it; an ack repeated is a no-op that succeeds. A put from above the clock is refused
  "from the future".

The clock and a store outage (Redis or this service down while the trainer trains, acks or syncs):
the design is that the clock is never behind a version anyone else has seen, rather than that a put
from the future is held. The trainer retries a trained step's ack until it lands, before it reports
the step (services/trainer/consumer.py), so no rollout generates, and no collector puts, at a version
this clock lacks; the collector never waits on an ack. If the store loses an ack's write anyway (Redis
without fsync on every write), the coordinator re-checks the refused put against the version the
trainer published and sets the clock up to it with OpenJob's rewind_to_version
(services/coordinator/job_buffer.py).

Semantics every backend keeps: `backend.BufferBackend`; the page: docs/buffer.md.
"""
