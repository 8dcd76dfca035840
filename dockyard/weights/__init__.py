"""Moving weights from the trainer to rollout replicas, never inside an RPC.

collective.py     the torch.distributed weight-sync group (gloo on CPU, NCCL on GPU)
                  and the bucketed broadcast that runs on it
refit.py          the trainer's tensor names and shapes mapped onto the engine's
transport.py      the interface every transport keeps (send, receive, spec)
transports.py     the ways weights travel: the weight-sync group, a checkpoint folder; a transport from its spec
colocated.py      trainer and rollout on one device: CUDA IPC / shared-memory handles over the group's store
handles.py        the memory handles it shares and the signed messages that carry them
mailbox.py        the shared-memory words through which it asks and answers a repeat
colocated_sender.py, colocated_receiver.py
                  the colocated transport's two sides: rank 0 shares and stages, every other rank maps and copies
colocated_peer.py what both sides share: keys, pieces, copies, bounded waits
arena.py          a module's parameters in one buffer, and adjacent copies merged: a colocated refit is one memcpy
devices.py        where each member's weights live, checked before a group forms (one GPU, two ranks)
whole_tensor.py   the whole-tensor protocol of engines that take each tensor as one broadcast (SGLang)
synchronizer.py   the sync state machine around a transport, and recovery after a failure
group_source.py   a job's weight-sync group as the coordinator hands it out; the transport of a config
"""
