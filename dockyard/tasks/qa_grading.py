"""Rule-based grading of question-answering responses (HLE-style): final answer extraction and normalisation.

    completion ──final_answer──> the text after the LAST line that starts with "Answer:" (None: no such line)
      exactMatch:     normalise(answer) == normalise(reference), or both are the same number
      multipleChoice: chosen_letter(answer) == the reference letter

Normalisation (exactMatch), in this order:
  1. LaTeX wrappers are unwrapped: $...$, \\(...\\), \\[...\\], \\boxed{..}, \\text{..}, \\textbf{..},
     \\mathrm{..}, \\mathbf{..}, \\operatorname{..}; `\\,` `\\;` `\\!` and `~` become spaces;
  2. Unicode NFKC, lowercase;
  3. numbers: when both sides read as a number (an integer with optional 1,000 separators, a decimal,
     a fraction a/b, optional sign, optional trailing %), they match iff equal as exact fractions
     ("0.50" = "1/2" = ".5"; "50%" = "0.5"; no rounding tolerance: "0.333" != "1/3");
  4. otherwise every punctuation character (Unicode category P*: . , ; : ! ? ' " - ( ) [ ] { } ...)
     becomes a space and runs of whitespace collapse to one; math symbols (+ = ^ < > / * |) stay.

Multiple choice: the letter is read from the start of the answer text: "C", "(C)", "C)", "C.", "C: text",
"Option C", "\\boxed{C}" (case-insensitive; the reference is a letter).

Guarantees: pure standard library and self-contained, so its source is the grading program the sandbox
runs (dockyard/tasks/qa.py puts it in a RunTests program); `grade` never raises on any string.
"""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction

_ANSWER_LINE = re.compile(r"^\s*(?:\*\*)?answer(?:\*\*)?\s*:(?:\*\*)?(.*)$", re.IGNORECASE)
_WRAPPERS = re.compile(r"\\(?:boxed|text|textbf|textrm|mathrm|mathbf|operatorname)\s*\{")
_NUMBER = re.compile(r"^([+-]?)(\d{1,3}(?:,\d{3})+|\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*(\d+))?\s*(%?)$")
_CHOICE = re.compile(r"^(?:option\s+|choice\s+)?[(\[]?([a-z])(?:[)\].:]|\s|$)", re.IGNORECASE)


def final_answer(completion: str) -> str | None:
    """The text after the last "Answer:" line (markdown bold allowed); None when there is none."""
    found = None
    for line in completion.splitlines():
        match = _ANSWER_LINE.match(line)
        if match:
            found = match.group(1).strip()
    return found


def _unwrap_braces(text: str) -> str:
    """\\boxed{x} -> x for each wrapper command, matching its braces (nested braces kept)."""
    while match := _WRAPPERS.search(text):
        depth, end = 1, match.end()
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        inner = text[match.end() : end - 1] if depth == 0 else text[match.end() :]
        text = text[: match.start()] + inner + text[end:]
    return text


def strip_latex(text: str) -> str:
    text = _unwrap_braces(text.strip())
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left) + len(right):
            text = text[len(left) : len(text) - len(right)]
    return re.sub(r"\\[,;:! ]|~", " ", text).strip()


def as_number(text: str) -> Fraction | None:
    """The exact value of an integer, decimal, fraction or percentage; None for anything else."""
    match = _NUMBER.match(text.strip())
    if not match:
        return None
    sign, whole, denominator, percent = match.groups()
    value = Fraction(whole.replace(",", ""))
    if denominator is not None:
        if "." in whole or int(denominator) == 0:
            return None
        value /= int(denominator)
    if percent:
        value /= 100
    return -value if sign == "-" else value


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFKC", strip_latex(text)).lower()
    text = "".join(" " if unicodedata.category(c).startswith("P") else c for c in text)
    return " ".join(text.split())


def exact_match(answer: str, reference: str) -> bool:
    left, right = strip_latex(answer), strip_latex(reference)
    a, b = as_number(left), as_number(right)
    if a is not None and b is not None:
        return a == b
    return normalise(left) != "" and normalise(left) == normalise(right)


def chosen_letter(answer: str) -> str | None:
    """The letter an answer picks ("(C)", "C)", "C. text", "Option C", "\\boxed{C}"), upper-case."""
    match = _CHOICE.match(strip_latex(answer).strip())
    return match.group(1).upper() if match else None


def grade(completion: str, reference: str, answer_type: str) -> bool:
    """True iff the completion's final "Answer:" line matches the reference under the rules above."""
    answer = final_answer(completion)
    if answer is None:
        return False
    if answer_type == "multipleChoice":
        return chosen_letter(answer) == reference.strip().upper()
    return exact_match(answer, reference)
