"""What the end-to-end recipe runs share: one policy folder, warm-started by whichever run comes first.

`dockyard run` warm-starts the recipe's policy only when `policy.model_name` does not exist yet
and never writes to it afterwards (checkpoints go to the run folder), so the second recipe run of
the session (the vLLM one after the torch one) trains from the same warm start without paying
for it again; run alone, each still makes its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_policy_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-policy") / "model"
