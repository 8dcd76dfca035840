"""The trainer service: the policy, GRPO optimizer steps, weight broadcast, checkpoints.

    buffer ──SampleGroups──> TrainStep ──AckGroups──> buffer
                                │ weight_version += 1
    coordinator ──PushWeights──> side group broadcast ──> rollout replicas

Guarantees: groups are acked only after the optimizer step that consumed
them; the weight version counts optimizer steps; weights leave only over the
side group, never inside an RPC.
"""
