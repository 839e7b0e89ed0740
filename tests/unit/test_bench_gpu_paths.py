"""The one-process references of `hetdp bench gpu`'s path checks (``bench.gpu_paths``), against computations of their
own: a local SGD replay of one replica is plain SGD, and merged after every step by the samples on a linear loss it
is one process on the global batches."""

from __future__ import annotations

import torch

from hetdp.bench import gpu_paths as paths


def _split(rank0: int) -> list[list[list[int]]]:
    """Two ranks' samples of every step: the first ``rank0`` of each global batch on rank 0, the rest on rank 1."""
    trained: list[list[list[int]]] = [[], []]
    for epoch in range(paths.EPOCHS):
        for batch in paths.global_batches(epoch):
            order = batch.tolist()
            trained[0].append(order[:rank0])
            trained[1].append(order[rank0:])
    return trained


def test_one_replica_replays_as_plain_sgd_with_momentum_on_its_batches():
    run = paths.RUNS["local"]
    trained = [[batch.tolist() for epoch in range(paths.EPOCHS) for batch in paths.global_batches(epoch)]]
    model = run.make(paths.SEED)
    optimizer = torch.optim.SGD(model.parameters(), lr=paths.LR, momentum=paths.MOMENTUM)
    x, y, _ = paths.dataset().tensors
    for steps in trained[0]:
        index = torch.tensor(steps)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
    torch.testing.assert_close(paths.replicas_reference(run, trained), paths.flat(model))


def test_replicas_merged_after_every_step_by_their_samples_are_one_process_on_a_linear_loss():
    linear = {"make": paths.make_linear_model, "loss": paths.linear_loss, "momentum": 0.0}
    trained = _split(rank0=20)  # unequal: 20 and 12 samples, the short last step all on rank 0
    merged = paths.replicas_reference(paths.PathRun("local:1", **linear), trained)
    torch.testing.assert_close(merged, paths.reference(paths.PathRun("solo", **linear)))
    # merged only at the epochs' ends, the replicas drift apart from one process
    apart = paths.replicas_reference(paths.PathRun("local", **linear), trained)
    assert (apart - merged).abs().max() > 1e-3


def test_each_sample_once_holds_the_steps_to_the_samplers_global_batches():
    trained = _split(rank0=20)
    assert paths.each_sample_once(trained)
    moved = [[list(step) for step in rank] for rank in trained]
    moved[1][0].append(moved[1][1].pop())  # a sample trained a step early
    assert not paths.each_sample_once(moved)
    twice = [[list(step) for step in rank] for rank in trained]
    twice[1][0][0] = twice[0][0][0]  # one sample twice, another never
    assert not paths.each_sample_once(twice)
