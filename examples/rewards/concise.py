"""An example reward function for env.reward (docs/rewards.md): the test pass fraction, plus a small
bonus for a short answer. Run by the sandbox, never by a service:

    env:
      reward:
        - {reward: examples/rewards/concise.py:score, weight: 1.0}
"""


def score(task, completion, verdict):
    if verdict["tests_total"] == 0:
        return 0.0
    fraction = verdict["tests_passed"] / verdict["tests_total"]
    short = len(completion["text"].strip()) <= 2 * len(task["solution"].strip() or "x")
    return {"reward": fraction + (0.1 if short and fraction > 0 else 0.0)}
