"""asv_benches.history: one machine, one environment, and a move only when it stays."""

import json

import pytest

from asv_benches import history

COLUMNS = ["result", "params", "version", "started_at", "duration"]


def _write(folder, commit, date, times, env="virtualenv-py3.11"):
    """One asv results file: online_softmax and linear on NumPy at N = 4096."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(times)
    data = {"commit_hash": commit, "env_name": env, "date": date, "params": {},
            "result_columns": COLUMNS, "version": 2,
            "results": {"variants.Attention.time_forward": [
                [times[n] for n in names], [[repr(n) for n in names], ["'numpy'"], ["4096"]],
                "v", 0, 1.0]}}
    (folder / f"{commit[:8]}-{env}.json").write_text(json.dumps(data))


def _history(tmp_path, series, env="virtualenv-py3.11"):
    folder = tmp_path / "machine-a"
    for i, times in enumerate(series):
        _write(folder, str(i) * 40, 1000 * i, times, env)
    return history.load_history(str(tmp_path))


def test_a_confirmed_change_is_a_move_and_an_outlier_is_not(tmp_path):
    # online_softmax: 2x faster at commit 2 and stays; linear: one slow outlier at commit 1
    h = _history(tmp_path, [{"online_softmax": 1.0, "linear": 0.1},
                            {"online_softmax": 1.0, "linear": 0.2},
                            {"online_softmax": 0.5, "linear": 0.1},
                            {"online_softmax": 0.52, "linear": 0.1}])
    moved = list(history.moves(h, ("online_softmax", "numpy", 4096)))
    assert [(c[-1], a, b) for c, a, b in moved] == [("2", 1.0, 0.5)]
    assert list(history.moves(h, ("linear", "numpy", 4096))) == []
    table = history.format_table(h)
    assert "2222222 " in table and "1.00 s -> 500 ms" in table


def test_the_newest_commit_must_move_by_the_factor_squared(tmp_path):
    h = _history(tmp_path, [{"online_softmax": 1.0}, {"online_softmax": 1.5}])
    assert list(history.moves(h, ("online_softmax", "numpy", 4096))) == []  # 1.5 < 1.69
    h = _history(tmp_path / "b", [{"online_softmax": 1.0}, {"online_softmax": 1.8}])
    assert len(list(history.moves(h, ("online_softmax", "numpy", 4096)))) == 1


def test_commits_are_ordered_by_date_not_by_file_name(tmp_path):
    folder = tmp_path / "m"
    _write(folder, "f" * 40, 1, {"online_softmax": 1.0})
    _write(folder, "0" * 40, 2, {"online_softmax": 3.0})
    h = history.load_history(str(tmp_path))
    assert [c for c, _ in h.commits] == ["f" * 40, "0" * 40]


def test_two_machines_are_never_mixed(tmp_path):
    _write(tmp_path / "m1", "a" * 40, 1, {"online_softmax": 1.0})
    _write(tmp_path / "m2", "b" * 40, 2, {"online_softmax": 9.0})
    with pytest.raises(ValueError, match="2 machines"):
        history.load_history(str(tmp_path))
    h = history.load_history(str(tmp_path), "m2")
    assert [c for c, _ in h.commits] == ["b" * 40]


def test_a_machine_folder_without_results_is_not_a_machine(tmp_path):
    # CI runs `asv machine --machine ci` and a --dry-run: a folder with machine.json only
    _write(tmp_path / "m1", "a" * 40, 1, {"online_softmax": 1.0})
    (tmp_path / "ci").mkdir()
    (tmp_path / "ci" / "machine.json").write_text("{}")
    assert history.load_history(str(tmp_path)).machine == "m1"


def test_one_environment_by_default(tmp_path):
    folder = tmp_path / "m"
    for i in range(3):
        _write(folder, str(i) * 40, i, {"online_softmax": 1.0})
    _write(folder, "e" * 40, 9, {"online_softmax": 0.1}, env="existing-py")
    h = history.load_history(str(tmp_path))
    assert len(h.commits) == 3 and "e" * 40 not in dict(h.commits)
    h = history.load_history(str(tmp_path), env="existing-py")
    assert [c for c, _ in h.commits] == ["e" * 40]
