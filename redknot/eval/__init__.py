"""Evaluation of segment-reuse policies (``python -m redknot.eval``).

| module              | concept                                                     |
| ------------------- | ----------------------------------------------------------- |
| ``cases``           | the case file format (``shared/eval/FORMAT.md``)            |
| ``compose``         | a case as token ids with segment rows (reference backend)   |
| ``metrics``         | first-token and answer metrics                              |
| ``base``            | the backend contract (settings in, outputs per setting out) |
| ``reference_backend`` | the PyTorch reference path (CPU)                          |
| ``fidelity``        | the evaluation loop, summary and Pareto front               |
| ``cli``             | the command line                                            |
"""

from redknot.eval.base import (
    REFERENCE_LABEL,
    CaseShape,
    FidelityBackend,
    PolicyOutput,
    PolicySetting,
)
from redknot.eval.cases import Case, CaseFormatError, load_cases, parse_case, write_cases
from redknot.eval.metrics import answer_scores, first_token_scores, normalize, token_f1

__all__ = [
    "REFERENCE_LABEL",
    "Case",
    "CaseFormatError",
    "CaseShape",
    "FidelityBackend",
    "PolicyOutput",
    "PolicySetting",
    "answer_scores",
    "first_token_scores",
    "load_cases",
    "normalize",
    "parse_case",
    "token_f1",
    "write_cases",
]
