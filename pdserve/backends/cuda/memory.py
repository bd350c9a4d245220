"""How many KV-cache blocks a GPU holds, with --gpu-memory-utilization in vLLM's meaning: the
fraction of the device's total memory this server may use, weights, activations and KV cache
together. The arithmetic is a pure function (tested on the CPU); profile_activation_bytes measures
its input on the device, with one forward of the largest step before the cache exists."""
import torch


def kv_cache_blocks(total: int, free: int, weights: int, peak_activation: int, utilization: float,
                    bytes_per_block: int) -> int:
    """Blocks of bytes_per_block that fit in utilization x total after the weights and the peak
    activation memory of a step, and in what is free now after that step's activations (memory
    other processes hold is not ours to take). All in bytes; free is measured after the weights load."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(total * utilization) - weights - peak_activation
    kv = min(budget, free - peak_activation)
    blocks = kv // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"no room for the KV cache: {utilization:.2f} x {total / 2**30:.1f} GiB of GPU memory, less "
            f"{weights / 2**30:.2f} GiB of weights and {peak_activation / 2**30:.2f} GiB of activations, with "
            f"{free / 2**30:.1f} GiB free, leaves {kv / 2**20:.0f} MiB (one block: {bytes_per_block} bytes); raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, or free the GPU")
    return blocks


def profile_activation_bytes(run_step, device: torch.device) -> int:
    """The most memory run_step() allocates beyond what was allocated before it (the largest step's
    activations, logits and sampler scratch), freed again after."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak
