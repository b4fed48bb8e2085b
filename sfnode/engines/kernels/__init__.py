"""The arithmetic of the engine: linear layers in the precision the weights have (``quant``),
sfnode's own native kernels and decode step (``native``, ``native.c``; ``native_build`` compiles
them, for the node and for the wheel's ``setup.py``), the kernel family this CPU
runs faster (``choice``), torch operator helpers and the OpenMP team.

May import nothing of sfnode outside ``sfnode.engines.kernels`` but the core's atomic file
writes (``sfnode.linkf.atomic_files``); imports torch.
"""
