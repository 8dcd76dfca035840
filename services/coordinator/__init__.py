"""The coordinator: jobs, the weight-version clock, the side-group rendezvous, the collector.

    CreateJob ─> JobRunner (one asyncio task per job, sync GRPO):
        load policy on trainer + rollout ─> weights v0 over the side group
        repeat: collector (rollout.Generate ─> sandbox.RunTests ─> rewards ─> buffer.PutGroup)
                trainer.TrainStep ─> PushWeights/ReceiveWeights ─> validation every val_period
        ─> checkpoint ─> SUCCEEDED

Guarantees: a job moves only along PENDING → RUNNING → {SUCCEEDED, FAILED,
CANCELLED} (PENDING may also be cancelled); every step's metrics and every
validation go to runs/<job-id>/metrics.jsonl next to the resolved config.
"""
