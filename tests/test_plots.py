"""labkit.plots: figures drawn from plain rows, headless."""

from __future__ import annotations

import pytest

from labkit.bench import bus_bandwidth, message_sizes
from labkit.plots import bandwidth_plot


def _rows(n=2):
    rows = []
    for b in message_sizes(1024, 1 << 20):
        seconds = 20e-6 + b / 5e9
        algbw = b / seconds / 1e9
        rows.append({"bytes": b, "seconds": seconds, "algbw_GBps": algbw,
                     "busbw_GBps": bus_bandwidth(algbw, n), "ranks": n, "backend": "gloo"})
    return rows


@pytest.fixture(autouse=True)
def close_figures():
    yield
    from matplotlib import pyplot as plt

    plt.close("all")


def test_bandwidth_plot_draws_both_lines_on_log_axes():
    rows = _rows(n=4)
    fig = bandwidth_plot(list(reversed(rows)))  # any order: sorted by size before drawing
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [line.get_label().split()[0] for line in lines] == ["algbw", "busbw"]
    assert list(lines[0].get_xdata()) == [r["bytes"] for r in rows]
    assert list(lines[1].get_ydata()) == pytest.approx([r["busbw_GBps"] for r in rows])
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "message size" and "GB/s" in ax.get_ylabel()
    assert ax.get_title() == "all-reduce bandwidth: 4 ranks, gloo"
    fig.canvas.draw()  # renders headless (Agg) with the size labels
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert "1 KiB" in labels and "1 MiB" in labels


def test_bandwidth_plot_on_a_given_axes():
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    assert bandwidth_plot(_rows(), ax=ax) is fig


def test_single_rank_has_no_bus_bandwidth_line():
    fig = bandwidth_plot(_rows(n=1))
    assert [line.get_label().split()[0] for line in fig.axes[0].get_lines()] == ["algbw"]


def test_rows_without_rank_info_get_a_plain_title():
    rows = [{k: r[k] for k in ("bytes", "algbw_GBps", "busbw_GBps")} for r in _rows()]
    assert bandwidth_plot(rows).axes[0].get_title() == "all-reduce bandwidth"


@pytest.mark.parametrize("rows, match", [([], "no rows"), ([{"bytes": 1}], "busbw_GBps")])
def test_bandwidth_plot_rejects_what_it_cannot_draw(rows, match):
    with pytest.raises(ValueError, match=match):
        bandwidth_plot(rows)
