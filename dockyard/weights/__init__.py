"""Moving weights from the trainer to rollout replicas, never inside an RPC.

collective.py     the torch.distributed weight-sync group (gloo on CPU, NCCL on GPU)
                  and the bucketed broadcast that runs on it
refit.py          the trainer's tensor names and shapes mapped onto the engine's
transports.py     the two ways weights travel: the weight-sync group, a checkpoint folder
whole_tensor.py   the whole-tensor protocol of engines that take each tensor as one broadcast (SGLang)
synchronizer.py   the sync state machine around a transport, and recovery after a failure
group_source.py   a job's weight-sync group as the coordinator hands it out; the transport of a config
"""
