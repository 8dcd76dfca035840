"""Moving weights from the trainer to rollout replicas, never inside an RPC.

collective.py   the torch.distributed side group (gloo on CPU, NCCL on GPU)
                and the bucketed broadcast that runs on it
rendezvous.py   joining a job's side group from the coordinator's rendezvous
"""
