"""The CUDA backend (backend.py): Triton paged attention, decode CUDA graphs, the KV cache sized from the GPU's memory."""
