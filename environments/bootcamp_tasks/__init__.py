"""InternBootcamp-style task families: procedurally generated, verifiable reasoning problems with no download.

    from environments.bootcamp_tasks import FAMILIES, RandomTask
    case = FAMILIES["arithmetic"].generate(random.Random(0), difficulty=1)
    FAMILIES[case.family].score(case, "<answer>57</answer>")
"""

from environments.bootcamp_tasks.base import (
    MAX_DIFFICULTY,
    MIN_DIFFICULTY,
    Case,
    RewardConfig,
    TaskFamily,
    extract_answer,
    parse_key,
)
from environments.bootcamp_tasks.mix import FAMILIES, RandomTask, case_from_key, get_family

__all__ = [
    "FAMILIES",
    "MAX_DIFFICULTY",
    "MIN_DIFFICULTY",
    "Case",
    "RandomTask",
    "RewardConfig",
    "TaskFamily",
    "case_from_key",
    "extract_answer",
    "get_family",
    "parse_key",
]
