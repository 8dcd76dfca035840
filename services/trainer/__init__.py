"""The trainer service: the policy, GRPO optimizer steps, weight broadcast, checkpoints.

    buffer ──SampleGroupsStream──> TrainStep ──AckGroups──> buffer
                                │ weight_version += 1
    coordinator ──PushWeights──> weight-sync group broadcast ──> rollout replicas

    servicer.py       TrainerServicer (rank 0): calls the domain with checked requests, errors -> status
    requests.py       request checks (job ids, steps, demonstrations, metrics), protos -> domain types
    consumer.py       BufferConsumer: one job's lease (reclaim, then sample; payloads from the data plane
                      by reference), ledger check, acks retried until they land
    ledger.py         TrainedLedger: the fsynced record of trained groups that survives a crash
    ranks.py          COMMANDS, the one table every rank dispatches from; rank 0 publishes, the others follow
    weight_push.py    WeightPush: rank 0's synchronizer of a job, fed by the thread that gathers the weights
    policy.py         PolicyTrainer: model, reference, optimizer, schedule, GRPO and SFT steps, save/restore
    micro_batches.py  a rank's share of the batch as micro-batches: row/token budgets, packing
    logprobs.py       per-token logprobs and entropy at the sampling temperature
    sharding.py       FSDP2 sharding, full state dicts, the all-reduces of a step
    batch.py          experience -> padded tensors (validate_groups / validate_rows: dockyard.experience.trainable)
    experience.py     TrainingGroup / Sample (what a GRPO step learns from), SFT rows, staleness metrics
    checkpoint.py     checkpoint folders (step-<N>): atomic writes, latest, top-k retention
    settings.py       TrainerSettings: DOCKYARD_TRAINER_*

A module imports only modules listed below it. policy.py and everything
below it is plain Python and torch: no protobuf, no gRPC, so it is tested
without a server; RPC stubs appear only in servicer.py, requests.py,
consumer.py and weight_push.py.

Guarantees: groups are acked only after the optimizer step that consumed
them; the weight version counts optimizer steps; weights leave only over the
weight-sync group, never inside an RPC.
"""
