"""The CPU allocator of a process under a memory budget: the block cache (`block_cache.py`, its
C++ half in tiered/native/csrc/blocks.cpp)."""
