"""Triton kernels for the CUDA path, one module per kernel, references in `services.kernels.reference`.

Import the modules themselves (`from services.kernels.paged_attention import paged_attention`):
this package imports nothing, so `import services.kernels` never needs triton. Under
TRITON_INTERPRET=1 (set before triton is first imported) they run on CPU tensors; see
tests/kernels/conftest.py. `python -m services.bench.check_gpu` checks and times them on a GPU.
"""
