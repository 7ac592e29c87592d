"""The demo's report: each sync's pause, live apply against reload, in the table and the plot."""

from __future__ import annotations

import pytest

from miles_updater.demo import plot, print_table


def _row(version, mode, pause_s, scattered, reason=""):
    return dict(version=version, kind="delta", changed_fraction_bytes=0.01, changed_fraction_elements=0.02,
                wire_nbytes=1000, full_nbytes=100_000, publish_s=0.1, pull_s=0.2, pause_s=pause_s,
                apply_mode=mode, elements_scattered=scattered, loss=1.0, match=True, files_equal=True,
                applies=[dict(engine="engine0", mode=mode, reason=reason)])


ROWS = [
    dict(version=0, kind="seed", changed_fraction_bytes=0.0, changed_fraction_elements=0.0, wire_nbytes=0,
         full_nbytes=0, publish_s=0.0, pull_s=0.0, pause_s=0.0, loss=None, match=True, files_equal=True),
    _row(1, "reload", 0.31, 0, "engine has no /update_weights_from_pulled (an older engine): reloading"),
    _row(2, "live", 0.02, 4242),
]


def test_table_shows_each_syncs_pause_mode_and_scattered_elements(capsys):
    print_table(ROWS)
    out = capsys.readouterr().out
    line1 = next(line for line in out.splitlines() if line.lstrip().startswith("1 "))
    line2 = next(line for line in out.splitlines() if line.lstrip().startswith("2 "))
    assert "0.310" in line1 and "reload" in line1
    assert "0.020" in line2 and "live" in line2 and "4242" in line2
    assert "v1 engine0: reload (engine has no /update_weights_from_pulled" in out


def test_plot_draws_the_pause_of_each_sync_by_mode(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    labels = plot(ROWS, path)
    assert "pause, live" in labels and "pause, reload" in labels
    assert path.stat().st_size > 10_000
