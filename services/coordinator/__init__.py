"""The coordinator: jobs, the weight-version clock, the side-group rendezvous, the fleet, the collector.

    RegisterMember / Heartbeat ─> fleet (rollout replicas, sandbox workers; fleet.py)
    CreateJob ─> JobRunner (one asyncio task per job):
        wait for the fleet ─> load policy on trainer + every replica ─> weights v0 over the side group
        repeat: collector (Generate on a replica ─> RunTests on a worker ─> rewards ─> buffer.PutGroup)
                trainer.TrainStep ─> PushWeights/ReceiveWeights ─> validation every val_period
        ─> checkpoint ─> SUCCEEDED

Guarantees: a job moves only along PENDING → RUNNING → {SUCCEEDED, FAILED,
CANCELLED} (PENDING may also be cancelled); every step's metrics and every
validation go to runs/<job-id>/metrics.jsonl next to the resolved config.
"""
