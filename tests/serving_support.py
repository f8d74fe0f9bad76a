"""What the compnode holding a causal LM's output answers for rows sent with ``keep``, for the tests'
stand-ins of a deployment's ``run_batch`` (no tests here)."""

from __future__ import annotations

import torch

from fusionnet.serving.answers import RowAnswers


def answer_rows(outputs: torch.Tensor, keep: list[bool]) -> RowAnswers:
    """``serve_steps.kept`` on one-position-per-row ``outputs`` (``[rows, vocab]``): every row's argmax,
    the kept rows' outputs."""
    return RowAnswers(outputs.argmax(dim=-1), outputs[torch.tensor(keep, dtype=torch.bool)])
