from hetdp.sim.network import ring_allreduce


def test_a_ring_pays_2_n_minus_1_latencies_and_2_n_minus_1_over_n_transfers():
    cost = ring_allreduce(1000, payload_mb=40.0, latency_s=50e-6, bandwidth_gbps=10.0)
    assert cost.hops == 1998
    assert cost.latency_s == 1998 * 50e-6
    assert abs(cost.transfer_s - 1998 / 1000 * 40e6 * 8 / 10e9) < 1e-12
    assert cost.total_s == cost.latency_s + cost.transfer_s


def test_a_single_worker_pays_nothing():
    assert ring_allreduce(1, payload_mb=40.0, latency_s=50e-6, bandwidth_gbps=10.0).total_s == 0.0
