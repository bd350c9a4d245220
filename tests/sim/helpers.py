"""Simulations on hand-sized replicas and a step-time model simple enough to do in one's head."""
from pdserve.config import EngineConfig
from pdserve.engine.cost_model import StepCostModel
from pdserve.sim.cluster import KVTransfer, Placement, ReplicaSpec, Simulation
from pdserve.sim.costs import FittedStepTime
from pdserve.sim.workload import SimRequest

# 10 ms a step plus 1 ms a token
FAKE = FittedStepTime(StepCostModel((0.010, 0.001, 0.0, 0.0)))
# 99 tokens of 1000 bytes at 99 MB/s: 1 ms, plus 2 ms latency
TRANSFER = KVTransfer(bytes_per_token=1000, bandwidth=99e6, latency_s=0.002)


def spec(num_blocks=1000, block_size=16, budget=512, seats=64, **cfg) -> ReplicaSpec:
    c = EngineConfig(model="unused", device="cpu", block_size=block_size, max_num_batched_tokens=budget,
                     max_num_seqs=seats, **cfg)
    return ReplicaSpec(c, num_blocks, 4096, 1000)


def requests(*rows) -> list[SimRequest]:
    """rows of (arrival_s, prompt_len, output_len[, priority]); prompts of distinct ids."""
    out = []
    for i, (at, n, m, *prio) in enumerate(rows):
        out.append(SimRequest(at, [(i * 101 + j) % 1000 for j in range(n)], m, priority=prio[0] if prio else 0))
    return out


def simulate(reqs, placement=Placement(), sp=None, step_time=FAKE, **kw):
    sim = Simulation(sp or spec(), placement, step_time, transfer=TRANSFER, **kw)
    return sim, sim.run(reqs)
