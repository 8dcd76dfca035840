"""Agent trials: the built-in tool-calling scaffold, its tools in a sandbox session, and trajectories.

    scaffold.run_scaffold ──openai client──> policy endpoint (POST /v1/chat/completions, one session)
          │ tool calls
          └──> tools.Toolbox ──> session.SandboxSession (SessionExec / ReadFile / WriteFile over gRPC)
    endpoint GET /v1/sessions/{id}/trajectory ──trajectory.trial_trajectory──> Trajectory fields

These are library code: the coordinator's agent workers use them (services/coordinator/agent_trials.py),
and a scaffold run anywhere else can too.
"""
