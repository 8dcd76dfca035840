"""The optional model judge of question answering (env.judge): asks the policy endpoint whether a response
matches the reference answer, in the style of HLE's judge (an extracted final answer, then yes or no).

    (task.prompt, completion, task.answer) ──env.judge.prompt_template (default: config.JUDGE_TEMPLATE)──>
        one user message
        ──POST /v1/chat/completions (the job's model, through the policy endpoint)──> reply text
        ──parse_judgement──> "correct: yes" ─> PASSED (1/1) │ "correct: no" ─> FAILED (0/1)
    an HTTP error, a time-out, or a reply without a `correct: yes|no` line ──> ERROR (masked, never 0)

Where it sits (dockyard/tasks/envs.py): the sandbox's rule verdict comes first; the judge is asked only
about responses the rules reject, so an answer the rules accept never costs a model call.

Guarantees: the judge never raises to its caller: every failure is an ERROR verdict naming what failed;
the reply is read from its LAST `correct:` line, case-insensitive; the judge's calls carry no session
header, so they are not recorded as anyone's trajectory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dockyard.api.common.v1 import common_pb2
from dockyard.config import JUDGE_PLACEHOLDERS, JUDGE_TEMPLATE

_CORRECT = re.compile(r"^\s*\**correct\**\s*:\s*\**\s*(yes|no)\b", re.IGNORECASE | re.MULTILINE)
_EXTRACTED = re.compile(r"^\s*\**extracted_final_answer\**\s*:\s*(.*)$", re.IGNORECASE | re.MULTILINE)


class JudgeFailed(Exception):
    """The judge gave no usable judgement (no reply, or a reply without `correct: yes|no`)."""


def render(template: str, question: str, response: str, correct_answer: str) -> str:
    # One pass, not str.format: a question or response may hold braces, or a placeholder, of its own.
    values = dict(zip(JUDGE_PLACEHOLDERS, (question, response, correct_answer), strict=True))
    return re.sub("|".join(map(re.escape, values)), lambda m: values[m.group(0)], template)


def parse_judgement(reply: str) -> tuple[bool, str]:
    """(correct, the extracted final answer) from the judge's reply; JudgeFailed without a verdict line."""
    found = _CORRECT.findall(reply)
    if not found:
        raise JudgeFailed(f"the judge's reply has no 'correct: yes|no' line: {reply[-200:]!r}")
    extracted = _EXTRACTED.findall(reply)
    return found[-1].lower() == "yes", (extracted[-1].strip() if extracted else "")


@dataclass(frozen=True)
class Judge:
    """Asks `model` on the OpenAI-compatible endpoint at `base_url` (its /v1 path) with `api_key`."""

    base_url: str
    api_key: str
    model: str
    prompt_template: str = JUDGE_TEMPLATE
    max_new_tokens: int = 256
    temperature: float = 0.0
    timeout_seconds: float = 120.0

    async def ask(self, question: str, response: str, correct_answer: str) -> tuple[bool, str]:
        import openai  # the coordinator's dependency; the task loaders do not need it

        prompt = render(self.prompt_template, question, response, correct_answer)
        async with openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=1, timeout=self.timeout_seconds
        ) as client:
            try:
                reply = await client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.max_new_tokens,
                    temperature=self.temperature,
                )
            except openai.OpenAIError as exc:
                raise JudgeFailed(f"the judge's call failed: {type(exc).__name__}: {exc}") from None
        if not reply.choices:
            raise JudgeFailed("the judge's reply has no choice")
        return parse_judgement(reply.choices[0].message.content or "")

    async def verdict(self, question: str, response: str, correct_answer: str) -> common_pb2.Verdict:
        """PASSED or FAILED as the judge says; ERROR (masked) when it could not say."""
        try:
            correct, extracted = await self.ask(question, response, correct_answer)
        except JudgeFailed as exc:
            return common_pb2.Verdict(status=common_pb2.VERDICT_STATUS_ERROR, error_message=str(exc))
        status = common_pb2.VERDICT_STATUS_PASSED if correct else common_pb2.VERDICT_STATUS_FAILED
        said = f"judge: {'yes' if correct else 'no'} (extracted_final_answer: {extracted[:200]!r})"
        return common_pb2.Verdict(status=status, tests_passed=int(correct), tests_total=1, stdout=said)
