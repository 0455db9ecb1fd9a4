"""Pure-torch reference implementations written from the specs (the independent oracle).

Nothing here imports or calls the compiled extension. Speed is irrelevant; every function runs on
CPU and CUDA tensors with bit-identical results.
"""
