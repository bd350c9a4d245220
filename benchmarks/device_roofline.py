"""The device check's roofline phase (benchmarks/device_check.py): the device's two ceilings,
measured in the same run, then pdserve's engine against them on the Llama-3-8B-shaped checkpoint.

- copy probe: a device-to-device copy of a large bf16 tensor; bandwidth counts the bytes read and
  the bytes written (METHOD.md's rule), the median of the timed copies;
- GEMM probe: torch.matmul of two random n x n bf16 matrices (2 n^3 FLOPs; never zeros, which
  multiply faster), the median;
- batch-1 decode: the engine's forward for one token at a short context, against the time to move
  its bytes (every weight once, the K/V: pdserve/bench/step_cost.py) at the copy probe's bandwidth;
- prefill: the forward of one prompt of PREFILL tokens, its FLOPs (linears, causal attention, one
  row's lm_head) against the GEMM probe's peak.

The steps are `pdserve roofline`'s own hand-built ones (roofline.time_step; its machine probes
measure the CPU, these the device); forward times wait for the device (ModelRunner._now).
"""
from __future__ import annotations

import statistics
import time

import torch

# (device, dry run) sizes: the probe's bytes are far past the H200's 60 MB L2
SIZES = {False: dict(copy_bytes=4 << 30, gemm_n=8192, prefill=2048, context=128, decode_repeats=30,
                     prefill_repeats=5, probe_repeats=20),
         True: dict(copy_bytes=64 << 20, gemm_n=256, prefill=256, context=32, decode_repeats=5,
                    prefill_repeats=2, probe_repeats=5)}


def timed(fn, device: str, repeats: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `repeats` calls after `warmup`: CUDA events on a GPU, else a clock."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def copy_probe(nbytes: int, device: str, repeats: int) -> dict:
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = statistics.median(timed(lambda: dst.copy_(src), device, repeats))
    moved = 2 * src.numel() * src.element_size()   # read once, written once
    del src, dst
    return dict(bytes_moved=moved, seconds=t, bandwidth=moved / t, repeats=repeats)


def gemm_probe(n: int, device: str, repeats: int) -> dict:
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    t = statistics.median(timed(lambda: torch.matmul(a, b), device, repeats))
    del a, b
    return dict(n=n, dtype="bfloat16", seconds=t, flops=2 * n ** 3 / t, repeats=repeats)


def build_engine(path: str, device: str, prefill: int):
    from pdserve.engine.llm_engine import LLMEngine
    kwargs = dict(model=path, device=device, dtype="bfloat16", max_num_batched_tokens=prefill, max_num_seqs=8,
                  max_model_len=prefill + 256, num_kv_blocks=-(-(prefill + 256) // 16) + 8, block_size=16)
    if device == "cpu":
        kwargs["cpu_kernels"] = False   # the dry run: torch's ops, as on a device without the CPU kernels
    return LLMEngine(**kwargs)


def run(out_path: str, device: str, model: str, dry_run: bool) -> dict:
    from benchmarks.device_records import save, sync
    from pdserve.bench.roofline import held_cost, time_step
    from pdserve.bench.step_cost import phase_steps, step_cost

    s = SIZES[dry_run]
    rec = dict(phase="roofline", device=device, model=model, sizes=s)
    if device.startswith("cuda"):
        rec["gpu"] = torch.cuda.get_device_name()
    rec["copy"] = copy_probe(s["copy_bytes"], device, s["probe_repeats"])
    rec["gemm"] = gemm_probe(s["gemm_n"], device, s["probe_repeats"])
    save(out_path, rec)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()   # the probes' 8 GiB back to the device: the engine sizes its cache from free memory

    t0 = time.monotonic()
    engine = build_engine(model, device, s["prefill"])
    sync(device)
    rec["engine"] = dict(load_s=round(time.monotonic() - t0, 1), backend=engine.runner.backend.describe())
    mc, held = held_cost(engine)
    rec["engine"]["weights_held_bytes_per_weight"] = held
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    ids = torch.randint(vocab, (s["prefill"] + 8,), generator=torch.Generator().manual_seed(0)).tolist()
    save(out_path, rec)

    seqs, rows = phase_steps("decode", 1, s["context"])
    cost = step_cost(mc, seqs, rows)
    forward, execute = time_step(engine, seqs, ids, s["decode_repeats"])
    t = statistics.median(forward)
    read = cost.bytes / rec["copy"]["bandwidth"]
    rec["decode"] = dict(batch=1, context=s["context"], bytes=cost.bytes, weight_bytes=cost.bytes_weights,
                         forward_ms=t * 1e3, execute_ms=statistics.median(execute) * 1e3, read_ms=read * 1e3,
                         bandwidth_fraction=read / t, achieved_bandwidth=cost.bytes / t, repeats=len(forward))
    save(out_path, rec)

    seqs, rows = phase_steps("prefill", 1, s["prefill"])
    cost = step_cost(mc, seqs, rows)
    forward, execute = time_step(engine, seqs, ids, s["prefill_repeats"])
    t = statistics.median(forward)
    rec["prefill"] = dict(tokens=s["prefill"], flops=cost.flops, forward_ms=t * 1e3,
                          execute_ms=statistics.median(execute) * 1e3, achieved_flops=cost.flops / t,
                          peak_fraction=cost.flops / t / rec["gemm"]["flops"], repeats=len(forward))
    save(out_path, rec)
    return rec
