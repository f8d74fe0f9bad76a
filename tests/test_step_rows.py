"""``broker.step_rows``: the metrics rows a checkpoint or replica pointer names, appended once each
instead of written again with every save, and never fewer on disk than the last saved document names."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusionnet.broker.step_rows import StepRows


def _rows(steps: range, tag: str = "") -> list[dict]:
    return [{"step": s, "loss": float(s), "tag": tag} for s in steps]


def test_growing_rows_are_appended_and_a_prefix_writes_nothing(tmp_path: Path) -> None:
    log = StepRows(tmp_path, "rows-ckpt")
    progress = _rows(range(3))
    first = log.sync(progress)
    progress += _rows(range(3, 6))
    path = tmp_path / first["file"]
    size = path.stat().st_size
    second = log.sync(progress)
    assert second == {"file": first["file"], "count": 6} and path.stat().st_size == 2 * size  # appended
    assert log.sync(progress[:4]) == {"file": first["file"], "count": 4}  # a prefix: names fewer lines
    assert path.stat().st_size == 2 * size
    assert log.load(second) == progress and log.load({"file": first["file"], "count": 4}) == progress[:4]


def test_rows_replaced_after_a_recovery_go_to_a_new_file_the_old_one_kept_until_pruned(
    tmp_path: Path,
) -> None:
    log = StepRows(tmp_path, "rows-ckpt")
    progress = _rows(range(6))
    before = log.sync(progress)
    replayed = progress[:3] + _rows(range(3, 5), "replayed")  # steps 3.. ran again after a failover
    after = log.sync(replayed)
    assert after["file"] != before["file"] and after["count"] == 5
    assert log.load(before) == progress  # the document saved before still reads its rows (a crash here)
    log.prune()  # its new document is saved: the old generation goes
    assert sorted(p.name for p in tmp_path.iterdir()) == [after["file"]]
    assert log.load(after) == replayed


def test_a_restarted_process_writes_a_new_generation_and_reads_the_old(tmp_path: Path) -> None:
    old = StepRows(tmp_path, "rows-replicas")
    saved = old.sync(_rows(range(4)))
    again = StepRows(tmp_path, "rows-replicas")  # a new broker process: it cannot tell its rows by identity
    resumed = again.load(saved)
    assert resumed == _rows(range(4))
    now = again.sync(resumed + _rows(range(4, 5)))
    assert now["file"] != saved["file"] and again.load(now) == _rows(range(5))
    with pytest.raises(ValueError, match="holds 5 rows, the document names 9"):
        again.load({"file": now["file"], "count": 9})
    with pytest.raises(ValueError, match="bad file name"):
        again.load({"file": "../ckpt.json", "count": 1})
