"""The native library (csrc/: the `native` attention kernel, the fused row-wise ops, the block
cache's allocator), built once by `build.py` and loaded by `library.py`; every user of it holds a
pure-PyTorch fallback."""
