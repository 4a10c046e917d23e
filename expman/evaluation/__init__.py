"""The evaluate and benchmark stages: reference speculative decoding, the engine benchmark, the fault gate."""
