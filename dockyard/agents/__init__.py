"""Agent trials: the built-in tool-calling scaffold, its tools in a sandbox session, and trajectories.

    scaffold.run_scaffold ──openai client──> policy endpoint (POST /v1/chat/completions, one session)
          │ tool calls
          └──> tools.Toolbox ──> session.SandboxSession (SessionExec / ReadFile / WriteFile over gRPC)
    tool_calls.ToolRules: is a call valid for the offered tools (the endpoint's parsers and the Toolbox)
    tool_formats: model text ──parse(format)──> content + tool calls, one module per model family's format
        (the endpoint reads replies with it, preflight checks a job's format against its chat template)
    endpoint GET /v1/sessions/{id}/trajectory ──contract.TrajectoryDocument──trial_tokens──> Trajectory fields

These are library code: the coordinator's agent workers use them (services/coordinator/agent_trials.py),
and a scaffold run anywhere else can too. contract.py is the endpoint's side of the agent path too:
the session header and the session and trajectory models both services import.
"""
