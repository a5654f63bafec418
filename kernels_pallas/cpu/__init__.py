"""The CPU path: C++ kernels (attention.cc, linear.cc, common.h) built with the machine's compiler and
called through XLA's FFI (kernel.py, their one door over library.py, attention.py, linear.py and
packing.py), and a pure-XLA paged attention (xla.py) where they cannot run."""
