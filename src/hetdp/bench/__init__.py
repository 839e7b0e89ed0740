"""The reproducible experiments behind ``hetdp bench NAME``, one module per experiment.

Each module exposes ``add_arguments(parser)``, ``run(args) -> dict`` (the JSON
figures) and ``render(result) -> str`` (the table). ``hetdp bench`` adds the
common ``--quick``, ``--json PATH`` and ``--seed`` flags to every one.
"""

BENCHMARKS: dict[str, str] = {
    "allocation": "equal vs static vs adaptive task allocation on emulated unequal workers, each speed-up beside its "
                  "ideal, and the drop-in's overhead against torch DDP",
    "cadp": "C-ADP vs equal-split DDP and local SGD on emulated geo-distributed devices (digits at 150 KB/sample)",
    "planner": "C-ADP planners on random heterogeneous clusters of 8 to 10,000 devices: exact vs ALM, objective and time",
    "collectives": "latency of solo / majority / quorum partial allreduce vs all_reduce under skew (eager-SGD Fig. 8)",
    "eager": "eager-SGD's solo and majority partial allreduce vs synchronous SGD with one random straggler per step "
             "(eager-SGD Fig. 10)",
    "imbalance": "LSTM on variable-length sequences: time to accuracy of sync vs solo vs majority (eager-SGD Fig. 13), "
                 "and count- vs cost-balanced steps",
    "devices": "adaptive allocation on emulated devices (fixed costs, knees, memory caps): paper's rule vs piecewise, "
               "efficiency modelled and measured",
    "compose": "allocation x synchronization under unequal speeds and a random straggler: time to accuracy per pairing",
    "drift": "adaptive allocation when a device slows down after the shares settled: steps to recover, re-plans",
    "simcheck": "the simulator against emulated ranks of the drop-in at 4, 8 and 16 ranks: predicted vs measured "
                "samples/s per setting and pairing",
    "chaos": "a random worker killed or hung at a random step under --max-restarts 2: recovery, the hung rank named, "
             "lost steps, parameter gap, resize 4 -> 3 ranks",
    "subset": "ranks whose compute is worth less than their exchange sit out: a fast rank beside slow ones vs the fast "
              "one alone, and balanced speeds where everyone pays",
    "gpu": "on a real GPU: hetdp.DDP's overhead against torch DDP, and one GPU beside three CPU ranks under every "
           "pairing against the GPU alone (needs a CUDA GPU)",
    "fsdp": "the sharded drop-in (hetdp.fully_shard) at emulated speeds 1,1,2,4: adaptive vs equal shares beside the "
            "ideal, vs torch's own fully_shard, vs hetdp.DDP, parameter gap to one process, state bytes per rank, a "
            "memory cap on the fastest rank checked against the memory it held",
    "memory": "memory-sized shards (hetdp.fully_shard) on 4 ranks of memory 1,1,2,4: the largest model that trains, "
              "measured by real epochs, against torch's even shards; state per rank, speed, parameter gap",
    "frameworks": "hetdp under Lightning, Accelerate and transformers' Trainer on emulated speeds 1,1,2,4: epoch "
                  "speedup over each framework's own DDP path beside its ideal, shares reached, parameter gap to one "
                  "process",
    "links": "C-ADP and the drop-in over real rate-limited links between 4 emulated hosts (network namespaces, two "
             "sites, a 50 Mbit uplink): probed links, C-ADP's predicted vs measured epoch, speedup over DDP beside "
             "its ideal, accuracy (needs root)",
}
"""Benchmark name -> one-line description; the module is ``hetdp.bench.<name>``."""
