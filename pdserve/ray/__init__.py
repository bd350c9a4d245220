"""pdserve on Ray Serve: engine replicas behind one OpenAI endpoint, with KV-cache-aware routing
(docs/RAY.md). Needs the `ray` extra; nothing else in pdserve imports this package."""
