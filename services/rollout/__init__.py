"""The rollout service: generation engines that sample GRPO groups with logprobs.

    LoadPolicy(job config) --> engine per job (torch today; vLLM next) at weight_version 0
    Generate(prompt, n, sampling) --> n completions: tokens, per-token logprobs, text,
                                      finish reason, all stamped with one weight_version
    ReceiveWeights --> weights over the side group (not over gRPC)

Guarantees: sampling controls are validated at the boundary (INVALID_ARGUMENT
naming the field); an unknown job is NOT_FOUND; generation never blocks the
server's event loop; every completion carries the logprob of each sampled
token after temperature, before top-p/top-k truncation (engine.py), and the
weight version that produced it.
"""
