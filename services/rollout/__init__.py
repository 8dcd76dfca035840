"""The rollout service: generation engines that sample GRPO groups with logprobs.

    LoadPolicy(job config) --> engine per job (built-in torch, or vLLM's AsyncLLM) at weight_version 0
    Generate(prompt, n, sampling) --> n completions: tokens, per-token logprobs, text,
                                      finish reason, stamped with the weight version(s) that produced them
    ReceiveWeights --> weights over the weight-sync group or a checkpoint folder (never over gRPC)

Modules: engine.py (the interface every engine keeps), torch_engine.py (the built-in
engine; its decode batch in decode_batch.py, kv_slots.py and sampling.py), vllm_engine.py
and vllm_worker.py (the vLLM adapter), sglang_engine.py and sglang_weights.py (the SGLang
adapter; both adapters are imported only when a job asks for them; what they share is in
out_of_process.py), decoding.py (decoding
parameters, validated at the boundary), prompts.py (the prompt forms: text, token ids, chat
messages), job_engines.py (the engine factory and the engines by job), weight_receiver.py (the
replica's side of the weight sync, one synchronizer per job), servicer.py (protobuf <-> calls on
those two), settings.py.

Guarantees: decoding parameters are validated at the boundary (INVALID_ARGUMENT
naming the field; NaN and Inf refused); an unknown job is NOT_FOUND;
generation never blocks the server's event loop; every completion carries the
logprob of each sampled token after temperature, before top-p/top-k
truncation (engine.py), and the weight version(s) that produced it.
"""
