import csv

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from hetdp import EpochReport, MetricsConfig, StepFigures
from hetdp.figures.metrics import MetricsWriter


def test_the_writer_gives_one_csv_row_per_rank_and_step_and_tensorboard_scalars(tmp_path):
    writer = MetricsWriter(MetricsConfig(csv=tmp_path / "m.csv", tensorboard=tmp_path / "board"))
    writer.write_steps([StepFigures(step=s, epoch=0, shares=[1, 3], compute_s=[0.1, 0.2], wait_s=[0.1, 0.0])
                        for s in range(3)])
    writer.write_epoch(EpochReport(epoch=0, shares=[1, 3], steps=3, epoch_s=1.0, compute_s=[0.3, 0.6],
                                   wait_s=[0.3, 0.0], samples=[3, 9], loss=0.5))
    writer.close()
    with (tmp_path / "m.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(row["step"], row["rank"], row["share"]) for row in rows[:2]] == [("0", "0", "1"), ("0", "1", "3")]
    assert len(rows) == 6
    with (tmp_path / "m_epochs.csv").open() as handle:
        assert [row["loss"] for row in csv.DictReader(handle)] == ["0.5", "0.5"]
    board = EventAccumulator(str(tmp_path / "board"))
    board.Reload()
    assert [event.value for event in board.Scalars("share/rank1")] == [3.0, 3.0, 3.0]
    assert [event.value for event in board.Scalars("loss")] == [0.5]
