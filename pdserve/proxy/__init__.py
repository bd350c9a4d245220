"""Prefill/decode disaggregation, the proxy side: `pdserve proxy` sends each request to a prefill
worker (one token, KV kept under a lease), then to a decode worker with the returned
`kv_transfer_params`, and relays the answer; `pdserve serve --disaggregate` runs two workers and
the proxy on one machine. The contract with the workers is vLLM's (docs/API.md, "Disaggregated
serving")."""
