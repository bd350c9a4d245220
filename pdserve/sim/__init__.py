"""`pdserve simulate`: a discrete-event simulator of pdserve deployments.

Each simulated replica runs pdserve's own Scheduler, BlockManager and policy on real Sequence
objects; only the forward is replaced, by a step-time model (costs.py). docs/SIMULATOR.md has the
method, what is and is not modelled, and how it was validated."""
