"""The drop-in's shape: ``train/ddp.py`` coordinates parts that each do one job, and the parts do not reach back."""

import ast
from pathlib import Path

import hetdp.train

TRAIN = Path(hetdp.train.__file__).parent


def test_the_drop_in_stays_a_short_coordinator():
    assert len((TRAIN / "ddp.py").read_text().splitlines()) <= 350


def test_the_loader_and_the_checkpointer_see_the_model_through_protocols_not_its_module():
    for part in ("loader.py", "stepcheckpoint.py", "planning.py", "step.py", "tally.py", "hook.py", "caps.py"):
        tree = ast.parse((TRAIN / part).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "hetdp.train.ddp" not in imported, part
