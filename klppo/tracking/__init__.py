"""klppo.tracking: metrics to the console, a jsonl file, TensorBoard, W&B, MLflow, SwanLab; run records."""

from klppo.tracking.backends import TrackerError
from klppo.tracking.run_dir import GenerationLog, write_run_metadata
from klppo.tracking.tracker import Tracker

__all__ = ["GenerationLog", "Tracker", "TrackerError", "write_run_metadata"]
