"""A worker's failure in torchrun's error file: one line naming the rank, in the format torchrun's failure summary
reads, and the failure a launch ends in chosen from every rank's report."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from hetdp import ConfigError, PeerTimeoutError
from hetdp.runtime.errorfile import Report, report_of
from hetdp.launch.failures import first_failure


def test_torchrun_reads_the_line_and_hetdp_its_report(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    path = tmp_path / "error.json"
    report = report_of(ValueError("boom\nsecond line"), traceback="Traceback ...\nValueError: boom\n")
    report.write(path)
    failure = ProcessFailure(local_rank=1, pid=7, exitcode=1, error_file=str(path))  # what torchrun's summary shows
    assert failure.message == "rank 3 failed with ValueError: boom; the other ranks were stopped"
    assert failure.timestamp == int(report.time)
    assert Report.read(path) == report


def test_a_hetdp_error_is_its_first_line_with_its_rank_and_a_config_error_is_not_retried(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    refused = report_of(ConfigError("speeds must be positive, got [1.0, 0.0]"))
    assert (refused.line, refused.exit_code, refused.retry, refused.traceback) == (
        "speeds must be positive, got [1.0, 0.0] (rank 1)", 2, False, None)
    assert report_of(PeerTimeoutError("rank 2 stopped answering")).retry


def test_a_file_hetdp_did_not_write_holds_no_report(tmp_path):
    path = tmp_path / "error.json"
    path.write_text('{"message": {"message": "ValueError: boom", "extraInfo": {"timestamp": "1"}}}')  # @record's
    assert Report.read(path) is None
    assert Report.read(tmp_path / "absent.json") is None


def test_the_launch_ends_in_the_first_failure_no_peer_caused():
    broken_off = Report(rank=0, message="rank 0 failed with RuntimeError: Connection closed by peer", exit_code=1,
                        consequence=True, time=1.0)
    cause = Report(rank=2, message="rank 2 failed with ValueError: boom", exit_code=1, traceback="Traceback", time=2.0)
    failure = first_failure([broken_off, None, cause, cause])  # a report may come twice (torchrun's own copy)
    assert (failure.message, failure.rank, failure.traceback, failure.retry) == (cause.message, 2, "Traceback", True)
    assert first_failure([None]) is None


def test_ranks_that_raised_the_same_hetdp_error_are_named_together():
    same = [Report(rank=rank, message="batch_size must be >= 1, got 0", exit_code=2, retry=False, names_rank=False,
                   time=float(rank)) for rank in (2, 0)]
    failure = first_failure(same)
    assert (failure.message, failure.rank, failure.exit_code, failure.retry) == (
        "batch_size must be >= 1, got 0 (ranks 0, 2)", 0, 2, False)
