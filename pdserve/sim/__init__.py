"""`pdserve simulate`: a discrete-event simulator of pdserve deployments.

Each simulated replica is pdserve's own LLMEngine (scheduler, block manager, policy, step and
outputs, and for P/D workers the KV connector's contract) over real Sequence objects; only the
forward is replaced, by a runner that takes a step-time model's time (runner.py, costs.py).
docs/SIMULATOR.md has the method, what is and is not modelled, and how it was validated."""
