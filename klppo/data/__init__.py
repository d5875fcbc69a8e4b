"""klppo.data: Parquet prompt sets in verl's schema (GSM8K conversion, a built-in arithmetic set) and the
prompt loader that turns them into left-padded ``Batch`` objects. Knows nothing of the training loop."""

from klppo.data.dataset import LoaderSettings, LoaderStats, PromptLoader
from klppo.data.parquet_rows import DataError

__all__ = ["DataError", "LoaderSettings", "LoaderStats", "PromptLoader"]
