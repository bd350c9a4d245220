"""The cost of moving a prompt's KV cache from a prefill worker to a decode worker.

    python -m benchmarks.kv_transfer MODEL_DIR [--prompt-len 1024] [--requests 5] [--dtype float32] [--cache-only]

A prefill engine (--role prefill, --kv-transport shm: its listener serves tcp pulls too) runs in
a child process; this process runs a decode engine (--role decode, prefix cache off, so every
request pulls its whole prompt). For each transport and request: the child prefills the prompt
(its blocks leased; after the first request from its prefix cache, which keeps the run short on
a CPU), then the decode engine admits the request with the returned kv_transfer_params, pulls
the first prompt-len - 1 tokens' K/V and decodes one token. --cache-only skips the models: the
child leases blocks of a KV cache of the checkpoint's shape (random values) and this process
pulls them with the same transport code (the transfer alone, for a machine too busy to prefill).
Reports per transport the bytes per request, the pull's time (connect to lease released) and
GB/s, as one JSON line each."""
import argparse
import json
import multiprocessing as mp
import statistics
import time

PREFILL_ENGINE = dict(role="prefill", kv_transport="shm", enable_prefix_caching=True)
DECODE_ID = "bench-decode"   # the decode engine's id on the KV channel: the leases are made for it


def _cache_shape(model: str, num_blocks: int, block_size: int = 16) -> tuple:
    from pdserve.config import ModelConfig
    m = ModelConfig.from_dir(model)
    return 2, m.num_layers, num_blocks * block_size, m.num_kv_heads, m.head_dim


class _LeasedCache:
    """A prefill worker without a model: a shared-memory cache whose blocks it leases."""

    def __init__(self, model: str, num_blocks: int, dtype: str, secret: str):
        import torch
        from pdserve.kv_transfer import KVLayout, shm, tcp
        from pdserve.kv_transfer.lease import LeaseTable
        path, cache = shm.shared_kv_cache(_cache_shape(model, num_blocks), getattr(torch, dtype))
        cache.normal_()
        self.leases, self.dtype = LeaseTable(60.0), dtype
        self.server = tcp.KVServer("127.0.0.1", 0, self.leases, KVLayout(cache), 16, tcp.TransferStats(), secret, path)
        self.num_blocks = num_blocks

    def kv_transfer_info(self) -> dict:
        return {"dtype": self.dtype, "kv_port": self.server.port}

    def lease(self, rid: str, num_tokens: int) -> dict:
        holder = type("Holder", (), {})()
        holder.block_table = list(range(self.num_blocks // 2, self.num_blocks // 2 + -(-num_tokens // 16)))
        self.leases.add(rid, holder, num_tokens, DECODE_ID, "cache-only")
        return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": self.server.port,
                "remote_request_id": rid, "num_tokens": num_tokens, "block_size": 16, "dtype": self.dtype,
                "prompt_hash": "cache-only"}

    def close(self) -> None:
        self.server.close()


def _prefill_worker(conn, model: str, engine_kwargs: dict, cache_only: bool) -> None:
    from pdserve.kv_transfer import KVTransferParams
    from pdserve.sampling_params import SamplingParams
    if cache_only:
        engine = _LeasedCache(model, engine_kwargs["num_kv_blocks"], engine_kwargs["dtype"],
                              engine_kwargs["kv_transfer_secret"])
    else:
        from pdserve.engine.llm_engine import LLMEngine
        engine = LLMEngine(model, **engine_kwargs, **PREFILL_ENGINE)
    conn.send(engine.kv_transfer_info())
    n = 0
    while True:
        if not conn.poll(0.01):
            if not cache_only and engine.has_unfinished_requests():
                engine.step()   # frees released leases
            continue
        cmd, prompt = conn.recv()
        if cmd == "stop":
            engine.close()
            return
        n += 1
        if cache_only:
            conn.send(engine.lease(f"p{n}", len(prompt)))
            continue
        engine.add_request(f"p{n}", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                           kv_transfer_params=KVTransferParams(
                                                               do_remote_decode=True, decode_engine_id=DECODE_ID)))
        params = None
        while params is None:
            for out in engine.step():
                if out.finished:
                    params = out.kv_transfer_params
        conn.send(params)


def _engine_pull(dec, k: int, prompt: list[int], params: dict) -> tuple[int, float]:
    from pdserve.kv_transfer import KVTransferParams
    from pdserve.sampling_params import SamplingParams
    stats = dec.connector.stats
    before = (stats.bytes, stats.seconds)
    dec.add_request(f"d{k}", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                    kv_transfer_params=KVTransferParams.from_dict(params)))
    while dec.has_unfinished_requests():
        dec.step()
    assert stats.failures == 0, "a pull failed (see the log)"
    return stats.bytes - before[0], stats.seconds - before[1]


def _cache_pull(layout, params: dict, secret: str) -> tuple[int, float]:
    from pdserve.kv_transfer import tcp
    from pdserve.kv_transfer.layout import slot_runs
    n = params["num_tokens"] - 1
    runs = slot_runs(list(range(-(-n // 16))), 16, 0, n)
    t0 = time.perf_counter()
    peer = tcp.Peer(params["remote_host"], params["remote_port"], secret, DECODE_ID)
    got = tcp.pull(peer, params["remote_request_id"], params["prompt_hash"], 0, n, layout, runs, params["transport"])
    return got, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=5, help="per transport")
    ap.add_argument("--transports", nargs="+", default=["tcp", "shm"], choices=["tcp", "shm"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1, help="forward threads of each engine")
    ap.add_argument("--cache-only", action="store_true", help="no models: the transfer of a cache of their shape")
    args = ap.parse_args(argv)

    blocks = -(-(args.prompt_len + 16) // 16) * 2
    from pdserve.kv_transfer.auth import new_secret
    kwargs = dict(dtype=args.dtype, threads=args.threads, num_kv_blocks=blocks,
                  max_num_batched_tokens=max(512, args.prompt_len), kv_transfer_secret=new_secret())
    ctx = mp.get_context("spawn")   # (a fork would copy this process's threads' state)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_worker, args=(child, args.model, kwargs, args.cache_only), daemon=True)
    proc.start()
    child.close()   # a child that dies then ends recv() with EOFError, not a hang
    try:
        info = parent.recv()
        if args.cache_only:
            import torch
            from pdserve.kv_transfer import KVLayout
            layout = KVLayout(torch.zeros(_cache_shape(args.model, blocks), dtype=getattr(torch, args.dtype)))
            vocab = 1000
        else:
            from pdserve.engine.llm_engine import LLMEngine
            dec = LLMEngine(args.model, role="decode", enable_prefix_caching=False, kv_engine_id=DECODE_ID, **kwargs)
            vocab = dec.model_config.vocab_size
        prompt = [(7919 + i * 104729) % vocab for i in range(args.prompt_len)]
        k = 0
        for transport in args.transports:
            times, sizes = [], []
            for _ in range(args.requests):
                k += 1
                parent.send(("prefill", prompt))
                params = {**parent.recv(), "transport": transport}
                size, seconds = _cache_pull(layout, params, kwargs["kv_transfer_secret"]) if args.cache_only else _engine_pull(dec, k, prompt, params)
                sizes.append(size)
                times.append(seconds)
            ms = statistics.median(times) * 1e3
            print(json.dumps({"transport": transport, "mode": "cache-only" if args.cache_only else "engines",
                              "dtype": info["dtype"], "prompt_tokens": args.prompt_len, "requests": args.requests,
                              "bytes_per_request": sizes[0], "ms_per_request_median": round(ms, 2),
                              "ms_per_request_min": round(min(times) * 1e3, 2),
                              "gb_per_s_median": round(sizes[0] / (ms / 1e3) / 1e9, 2),
                              "gb_per_s_best": round(sizes[0] / min(times) / 1e9, 2)}), flush=True)
        if not args.cache_only:
            dec.close()
    finally:
        if proc.is_alive():
            parent.send(("stop", None))
        proc.join(30)
        if proc.is_alive():
            proc.terminate()


if __name__ == "__main__":
    main()
