"""The coordinator: jobs, the weight-version clock, weight-sync groups, the fleet, producing experience.

    RegisterMember / Heartbeat ─> fleet.py (rollout replicas, sandbox workers)
    GetWeightSyncGroup ─────────> weight_sync_groups.py (members, ranks, epochs of every job's group)
    servicer.py (protobuf <-> calls) ─> job_manager.py JobManager: ids, store recovery, preflight, runners
    CreateJob ─> jobs.py record (store.py persists it) ─> runner.py JobRunner, one asyncio task per job:
        wait for the fleet ─> load policy on trainer + every replica ─> weights v0 over the weight-sync group
        repeat: producer.py (tasks ─> collector.py: Generate ─> RunTests ─> reward_functions.py, rewards.py
                             ─> job_buffer.py: payload to the buffer's Redis + PutGroup, or PutGroupStream)
                trainer_client.py TrainStep ─> weight_sync.py PushWeights/ReceiveWeights ─> validation
        ─> checkpoint ─> SUCCEEDED          (recovery.py: resumes, trainer and coordinator restarts)

Guarantees: a job moves only along PENDING → RUNNING → {SUCCEEDED, FAILED,
CANCELLED} (PENDING may also fail or be cancelled); every step's metrics
(step_metrics.py) and every validation go to runs/<job-id>/metrics.jsonl next
to the resolved config (run_folder.py), and to the job's experiment trackers;
a few completions per step (samples.py) go to samples.jsonl and the trackers.
"""
