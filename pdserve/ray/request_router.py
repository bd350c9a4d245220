"""pdserve/routing.py's Router inside Ray Serve: the request router of the engine deployment's handle.

Serve calls choose_replicas for every request sent through a DeploymentHandle (here: from the
ingress). The ingress passes the prompt's block hashes as the `block_hashes` keyword argument, so
nothing is tokenized twice. Each replica reports its KV cache size in its routing stats
(EngineReplica.record_routing_stats), which bounds what the router assumes it holds. One rank with one replica is returned: if that replica is full
(max_ongoing_requests), Serve backs off and asks again."""
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pdserve.routing import Router


class KVAwareRequestRouter(RequestRouter):
    def initialize_state(self, policy: str = "prefix-aware", capacity_blocks: int = 1 << 16,
                         min_match_blocks: int = 1, max_imbalance: int = 8):
        self.router = Router(policy, capacity_blocks, min_match_blocks, max_imbalance)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        hashes = (pending_request.kwargs.get("block_hashes") or []) if pending_request is not None else []
        # a stable order, so round-robin and ties do not depend on how Serve listed them
        chosen, _ = self.router.choose(sorted(by_id, key=lambda r: r.unique_id), hashes)
        self.router.record(chosen, hashes, (by_id[chosen].routing_stats or {}).get("kv_blocks"))
        return [[by_id[chosen]]]

    def on_send_request(self, replica_id: ReplicaID):
        super().on_send_request(replica_id)
        self.router.sent(replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str):
        super().on_request_completed(replica_id, internal_request_id)
        self.router.completed(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.router.remove(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]):
        super().update_replicas(replicas)
        self.router.keep_only({r.replica_id for r in replicas})
