"""The CPU backend (backend.py) and everything CPU-specific it runs on: the kernels (kernels/),
packed linears, huge pages, the kernel layers and the decoder stack."""
