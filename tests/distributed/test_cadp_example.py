"""examples/cadp_train.py under `hetdp run`: C-ADP as the owner's plan, hetdp.distribute and the drop-in's local
training, merged every epoch."""

import re
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"


def test_cadp_example_trains_each_device_on_its_planned_share_through_the_drop_in(hetdp_run):
    completed = hetdp_run("-n", 4, EXAMPLES / "cadp_train.py", "--cluster", EXAMPLES / "cadp_cluster.toml",
                          "--epochs", 2, "--no-emulate")
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.strip().splitlines()
    losses = [float(re.match(r"epoch \d: [\d.]+ s, loss ([\d.]+); ", line).group(1)) for line in lines[-3:-1]]
    assert losses[1] < losses[0]  # the merged model of epoch 0 is where every device starts epoch 1
    found = re.match(r"samples per device: owner-gpu (\d+), gpu-1g (\d+), cpu-200m (\d+), cpu-50m (\d+); planned "
                     r"T_total [\d.]+ s; test accuracy (0\.\d+)", lines[-1])
    assert found, lines[-1]
    samples = list(map(int, found.groups()[:4]))
    assert sum(samples) == 1438 and samples[0] > samples[2] > 0  # the digits' training split, most to the GPUs
