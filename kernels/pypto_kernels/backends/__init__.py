"""Device fast paths, imported lazily by :func:`pypto_kernels.registry.load_backends`.

Each module exposes ``register(add)`` where ``add(name, backend, fn)`` registers one fast path.
"""
