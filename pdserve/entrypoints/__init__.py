"""The commands that start servers: `pdserve serve` (one engine, Ray Serve replicas, or a
prefill/decode pair) and `pdserve proxy`."""
