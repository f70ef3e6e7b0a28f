"""``deepinfer run-batch``: OpenAI Batch files through the engine with bounded memory, results
written as they finish, resumable (:func:`run_batch`; ``docs/run-batch.md``)."""

from deepinfer_core.batch.runner import run_batch
from deepinfer_core.batch.summary import BatchSummary

__all__ = ["BatchSummary", "run_batch"]
