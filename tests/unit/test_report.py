"""Tables printed a row at a time, the launcher's progress bar, and the allocation plots."""

from hetdp.bench.plots import compute_wait_figure, shares_figure
from hetdp.report import LaunchProgress, StreamingTable, format_table


def test_a_streamed_table_prints_its_header_once_and_aligns_like_a_whole_one():
    rows = [{"policy": "equal", "epoch s": 2.5}, {"policy": "adaptive", "epoch s": 1.25}]
    table = StreamingTable(["policy", "epoch s"], widths={"policy": 8})
    streamed = "\n".join(table.format(row) for row in rows)
    assert streamed == format_table(rows)


def test_a_column_shows_its_floats_to_one_number_of_decimals_and_never_an_exponent():
    text = format_table([{"s": 2.93, "samples/s": 626900.0, "per rank": [0.1234, 1.5]},
                         {"s": 2.966, "samples/s": 12.5, "per rank": [0.5, 0.25]},
                         {"s": 1.826, "samples/s": 3.0, "per rank": [1.0, 2.0]}])
    rows = [line.split() for line in text.splitlines()[2:]]
    assert [row[0] for row in rows] == ["2.930", "2.966", "1.826"]
    assert [row[1] for row in rows] == ["626900", "12", "3"]
    assert [row[2] for row in rows] == ["0.123,1.500", "0.500,0.250", "1.000,2.000"]
    assert "e+" not in text


def test_progress_hands_over_the_rows_that_come_with_events():
    rows = []
    with LaunchProgress(5, "epochs", nproc=2, unit="epoch", on_row=rows.append) as progress:
        progress([{"advance": 0}])
        progress([])
        progress([{"advance": 1, "row": {"epoch": 0}}, {"advance": 2}, {"advance": 1, "row": {"epoch": 1}}])
    assert rows == [{"epoch": 0}, {"epoch": 1}]


def runs():
    def rows(policy, shares, replans):
        return [
            {"policy": policy, "epoch": epoch, "steps": 10, "start_shares": shares[0], "shares": shares[-1],
             "replans": replans if epoch == 0 else [], "compute_s": [2.0, 2.0, 1.0, 0.5],
             "wait_s": [0.0, 0.0, 1.0, 1.5], "wall_s": 2.0 * (epoch + 1), "accuracy": 0.5}
            for epoch in range(3)
        ]

    return {"equal": rows("equal", [[32] * 4], []),
            "adaptive": rows("adaptive", [[32] * 4, [16, 16, 32, 64]], [[2, [16, 16, 32, 64]]])}


def test_shares_stack_so_that_equal_shares_do_not_hide_each_other():
    figure = shares_figure(runs())
    for axes in figure.axes:
        bands = axes.collections
        assert len(bands) == 4  # one band per rank, stacked: ranks 0 and 1 both at 16 stay two bands
        tops = [band.get_paths()[0].vertices[:, 1].max() for band in bands]
        assert tops == sorted(tops) and tops[-1] == 128  # each on top of the previous, up to the global batch
    labels = [text.get_text() for text in figure.axes[1].texts]
    assert labels == ["rank 0: 16", "rank 1: 16", "rank 2: 32", "rank 3: 64"]


def test_compute_wait_legend_sits_outside_the_bars_and_the_title_says_they_are_means():
    figure = compute_wait_figure(runs())
    (axes,) = figure.axes
    assert axes.get_legend() is None and len(figure.legends) == 1
    figure.canvas.draw()
    legend_box = figure.legends[0].get_window_extent()
    assert legend_box.y1 <= axes.get_window_extent().y0  # entirely below the plot area
    assert "mean over all 3 epochs" in axes.get_title()
