"""Atomic writes leave whole files with the permissions a plain write would give."""

import json
import os
import stat

from hetdp.files import write_json


def test_written_json_gets_the_permissions_of_a_plain_write(tmp_path):
    plain = tmp_path / "plain.json"
    plain.write_text("{}")
    atomic = write_json(tmp_path / "atomic.json", {"a": 1})
    assert stat.S_IMODE(os.stat(atomic).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
    assert json.loads(atomic.read_text()) == {"a": 1}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["atomic.json", "plain.json"]  # no temporary left


def test_the_umask_applies(tmp_path):
    previous = os.umask(0o077)
    try:
        path = write_json(tmp_path / "private.json", [])
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
