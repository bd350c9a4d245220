"""The cost of moving a prompt's KV cache from a prefill worker to a decode worker.

    python -m benchmarks.kv_transfer MODEL_DIR [--prompt-len 1024] [--requests 5] [--dtype float32]

A prefill engine (--role prefill) runs in a child process; this process runs a decode engine
(--role decode, prefix cache off, so every request pulls its whole prompt). For each transport
and request: the child prefills the prompt (its blocks leased; after the first request from its
prefix cache, which keeps the run short on a CPU), then the decode engine admits the request
with the returned kv_transfer_params, pulls the first prompt-len - 1 tokens' K/V and decodes one
token. Reports per transport the bytes per
request, the pull's time (connect to lease released, from the decode engine's stats) and GB/s,
as one JSON line each."""
import argparse
import json
import multiprocessing as mp
import statistics
import time

PREFILL_ENGINE = dict(role="prefill", kv_transport="shm", enable_prefix_caching=True)   # (its listener serves tcp pulls too)


def _prefill_worker(conn, model: str, engine_kwargs: dict) -> None:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kv_transfer import KVTransferParams
    from pdserve.sampling_params import SamplingParams
    engine = LLMEngine(model, **engine_kwargs, **PREFILL_ENGINE)
    conn.send(engine.kv_transfer_info())
    n = 0
    while True:
        if not conn.poll(0.01):
            if engine.has_unfinished_requests():
                engine.step()   # frees released leases
            continue
        cmd, prompt = conn.recv()
        if cmd == "stop":
            engine.close()
            return
        n += 1
        engine.add_request(f"p{n}", prompt, SamplingParams(max_tokens=1, temperature=0,
                                                           kv_transfer_params=KVTransferParams(do_remote_decode=True)))
        params = None
        while params is None:
            for out in engine.step():
                if out.finished:
                    params = out.kv_transfer_params
        conn.send(params)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=5, help="per transport")
    ap.add_argument("--transports", nargs="+", default=["tcp", "shm"], choices=["tcp", "shm"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="forward threads of each engine")
    args = ap.parse_args(argv)

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kv_transfer import KVTransferParams
    from pdserve.sampling_params import SamplingParams

    blocks = -(-(args.prompt_len + 16) // 16) * 2
    kwargs = dict(dtype=args.dtype, threads=args.threads, num_kv_blocks=blocks,
                  max_num_batched_tokens=max(512, args.prompt_len))
    ctx = mp.get_context("spawn")   # (a fork would copy this process's threads' state)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill_worker, args=(child, args.model, kwargs), daemon=True)
    proc.start()
    child.close()   # a child that dies then ends recv() with EOFError, not a hang
    try:
        info = parent.recv()
        dec = LLMEngine(args.model, role="decode", enable_prefix_caching=False, **kwargs)
        vocab = dec.model_config.vocab_size
        prompt = [(7919 + i * 104729) % vocab for i in range(args.prompt_len)]
        k = 0
        for transport in args.transports:
            times, sizes = [], []
            for _ in range(args.requests):
                k += 1
                parent.send(("prefill", prompt))
                params = {**parent.recv(), "transport": transport}
                before = (dec.connector.stats.bytes, dec.connector.stats.seconds)
                dec.add_request(f"d{k}", prompt, SamplingParams(
                    max_tokens=1, temperature=0, kv_transfer_params=KVTransferParams.from_dict(params)))
                while dec.has_unfinished_requests():
                    dec.step()
                stats = dec.connector.stats
                assert stats.failures == 0, "a pull failed (see the log)"
                sizes.append(stats.bytes - before[0])
                times.append(stats.seconds - before[1])
            ms = statistics.median(times) * 1e3
            print(json.dumps({"transport": transport, "dtype": info["dtype"], "prompt_tokens": args.prompt_len,
                              "requests": args.requests, "bytes_per_request": sizes[0],
                              "ms_per_request_median": round(ms, 2),
                              "ms_per_request_min": round(min(times) * 1e3, 2),
                              "gb_per_s_median": round(sizes[0] / (ms / 1e3) / 1e9, 2)}), flush=True)
        dec.close()
    finally:
        if proc.is_alive():
            parent.send(("stop", None))
        proc.join(30)
        if proc.is_alive():
            proc.terminate()


if __name__ == "__main__":
    main()
