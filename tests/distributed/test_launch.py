"""Launched workers report back: rank 0's events reach the launcher as they come, and a failure is one story: a
HetDPError ends the launch in one line (exit code 2); any other exception in its rank's traceback, printed once, then
one line naming the rank, with its exit code; never a traceback per rank or torchrun's summary. Under torchrun itself,
a worker that joined with hetdp.init_distributed leaves that line in its error file, as torchrun's root cause."""

import re
import textwrap
from pathlib import Path

import pytest

import hetdp.cli.run
from hetdp.errors import HetDPError, WorkerError
from hetdp.launch import run_local

EVENTS_SCRIPT = """
    import sys
    import sibling                                   # a module beside the script: sys.path[0] is its folder

    from hetdp.launch import EventWriter
    import os

    assert __name__ == "__main__"
    if os.environ["RANK"] == "0":
        print("ARGS", sys.argv[2:])
    writer = EventWriter(enabled=os.environ["RANK"] == "0")
    for step in range(int(sys.argv[1])):
        writer.update(row={"step": step, "word": sibling.WORD})
    writer.update(2)
"""


@pytest.fixture
def script(tmp_path):
    def write(body: str, name: str = "train.py"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(body))
        return path

    return write


# A script's flags that abbreviate torchrun's own reach the script: the events' launch passes them through hetdp's
# worker (report_errors=True), the handshake's straight to the script.
ABBREVIATING_FLAGS = ["--signal", "KILL", "--nnodes", "3"]


def test_rank_0_events_reach_the_launcher_in_order_and_flags_like_torchruns_reach_the_script(script):
    script("WORD = 'beside'\n", name="sibling.py")
    seen = []
    completed = run_local(script(EVENTS_SCRIPT), 2, ["3", *ABBREVIATING_FLAGS], follow=seen.extend,
                          report_errors=True, capture=True, timeout_s=120)
    assert completed.returncode == 0, completed.stdout
    rows = [{"advance": 1, "row": {"step": step, "word": "beside"}} for step in range(3)]
    assert seen == [{"advance": 0}, *rows, {"advance": 2}]  # the first says the workers are up
    assert f"ARGS {ABBREVIATING_FLAGS}" in completed.stdout


HANDSHAKE_SCRIPT = """
    import os, sys, time
    from pathlib import Path
    from hetdp.launch import EventWriter

    if os.environ["RANK"] == "0":
        print("ARGS", sys.argv[2:])
        EventWriter().update(row={"go": sys.argv[1]})
        deadline = time.monotonic() + 60
        while not Path(sys.argv[1]).exists():    # the launcher answers the row while this rank still runs
            if time.monotonic() > deadline:
                sys.exit("no answer from the launcher")
            time.sleep(0.05)
"""


def test_events_reach_the_launcher_while_the_workers_run_and_flags_like_torchruns_reach_the_script(script, tmp_path):
    def answer(events):
        for event in events:
            if "row" in event:
                Path(event["row"]["go"]).touch()

    completed = run_local(script(HANDSHAKE_SCRIPT), 2, [tmp_path / "go", *ABBREVIATING_FLAGS], follow=answer,
                          capture=True, timeout_s=120)
    assert completed.returncode == 0, completed.stdout
    assert f"ARGS {ABBREVIATING_FLAGS}" in completed.stdout


def test_a_workers_hetdp_error_is_raised_once_by_the_launcher_and_hetdp_run_ends_in_its_line(script, hetdp_run,
                                                                                               monkeypatch):
    # One launch checks both layers: what `run_local` raises (seen by a spy on the one `hetdp run` calls), and the
    # line `hetdp run` turns it into.
    raised: list[BaseException] = []

    def spy(*args, **kwargs):
        try:
            return run_local(*args, **kwargs)
        except BaseException as error:
            raised.append(error)
            raise

    monkeypatch.setattr(hetdp.cli.run, "run_local", spy)
    path = script("import hetdp\nraise hetdp.ConfigError('the cluster has 4 devices but the group has 2 ranks')\n")
    completed = hetdp_run("-n", 2, path)
    # torchrun stops the other rank once one failed: it may or may not have reported the error too
    message = r"the cluster has 4 devices but the group has 2 ranks \((rank 0|rank 1|ranks 0, 1)\)"
    assert len(raised) == 1 and isinstance(raised[0], HetDPError), raised
    assert re.fullmatch(message, str(raised[0])), str(raised[0])
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr + completed.stdout
    assert re.fullmatch(f"hetdp run: error: {message}", completed.stderr.splitlines()[-1])


FAILING_RANK_SCRIPT = """
    import sys
    import torch
    import torch.distributed as dist

    import hetdp

    hetdp.init_distributed()
    if dist.get_rank() == 1:
        {failure}
    dist.all_reduce(torch.ones(1))                   # the others wait for rank 1 in a collective
"""


def test_a_ranks_exception_is_its_traceback_once_then_one_line_and_its_exit_code(script, hetdp_run):
    path = script(FAILING_RANK_SCRIPT.replace("{failure}", "raise ValueError('boom')"))
    completed = hetdp_run("-n", 3, path)
    output = completed.stderr + completed.stdout
    assert completed.returncode == 1
    assert output.count("Traceback") == 1 and "ValueError: boom" in output
    assert str(path) in output and "hetdp/launch/" not in output and "runpy" not in output
    assert "ChildFailedError" not in output and "elastic" not in output and "SIGTERM" not in output
    assert completed.stderr.splitlines()[-1] == (
        "hetdp run: error: rank 1 failed with ValueError: boom; the other ranks were stopped")


def test_a_rank_that_exits_with_a_code_ends_the_launch_with_it_in_one_line(script, hetdp_run):
    path = script(FAILING_RANK_SCRIPT.replace("{failure}", "sys.exit(3)"))
    completed = hetdp_run("-n", 2, path)
    assert completed.returncode == 3
    assert "Traceback" not in completed.stderr + completed.stdout
    assert completed.stderr.splitlines()[-1] == "hetdp run: error: rank 1 exited with 3; the other ranks were stopped"


def test_a_rank_killed_by_a_signal_is_one_line_naming_it(script, hetdp_run):
    path = script(FAILING_RANK_SCRIPT.replace("{failure}", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    completed = hetdp_run("-n", 2, path)
    assert completed.returncode == 128 + 9
    assert "Traceback" not in completed.stderr + completed.stdout and "elastic" not in completed.stderr
    assert completed.stderr.splitlines()[-1] == (
        "hetdp run: error: rank 1 died (signal SIGKILL); the other ranks were stopped")


def test_a_bug_in_a_worker_is_raised_once_with_its_rank_and_traceback(script):
    path = script("raise RuntimeError('a bug')\n")
    with pytest.raises(WorkerError, match=r"^rank [01] failed with RuntimeError: a bug; the other ranks were stopped$"
                       ) as caught:
        run_local(path, 2, report_errors=True, capture=True, timeout_s=120)
    assert caught.value.exit_code == 1
    assert caught.value.output.count("Traceback") == 1  # both ranks raised it: the first to fail tells it


EMULATION_SCRIPT = """
    import torch
    import hetdp

    hetdp.init_distributed()
    hetdp.DDP(torch.nn.Linear(2, 1))
"""


def test_under_torchrun_the_root_cause_is_one_line_naming_the_rank(script):
    """Emulation settings in the environment of a plain torchrun (an engine), for another number of ranks: each rank
    stops on one ConfigError, which its error file gives torchrun's failure summary in place of a link to the docs."""
    completed = run_local(script(EMULATION_SCRIPT), 2, env={"HETDP_SPEEDS": "1,2,3"}, capture=True, timeout_s=120)
    assert completed.returncode != 0
    root = completed.stdout[completed.stdout.index("Root Cause"):]
    assert re.search(r"traceback : the emulation gives 3 speeds \(HETDP_SPEEDS\) for a group of 2 ranks: give one "
                     r"per rank \(rank [01]\)\n", root), root
