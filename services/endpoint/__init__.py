"""The policy endpoint: a job's current policy as OpenAI- and Anthropic-compatible HTTP, token-faithful.

    scaffold ──HTTP──> app (FastAPI) ──sessions (recorder)──> backend ──gRPC Generate(prompt_token_ids)──> rollout

See docs/architecture.md ("The policy endpoint"). The endpoint holds no model,
only each job's tokenizer; it talks to the coordinator and rollout replicas
over gRPC only.
"""
