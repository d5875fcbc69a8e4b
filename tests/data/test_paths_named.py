"""A directory given as a Parquet file, and a missing checkpoint folder given to `klppo export`, are said as
what they are (they read "Parquet file not found" and "holds no 'actor' model")."""

from __future__ import annotations

import pytest

from klppo.data.parquet_rows import DataError, RowGroupSource


def test_a_directory_is_not_a_parquet_file(tmp_path):
    with pytest.raises(DataError, match=r"is a directory: name its Parquet files \(data.train_files"):
        RowGroupSource([str(tmp_path)])


def test_export_of_a_missing_folder_says_it_does_not_exist(tmp_path):
    from klppo.commands.export import export_checkpoint

    with pytest.raises(FileNotFoundError, match=r"nope does not exist \(pass a global_step_N folder"):
        export_checkpoint(tmp_path / "nope", tmp_path / "out")
