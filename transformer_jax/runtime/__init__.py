"""The process's plumbing, below everything else: the platform programs are built for (platform.py), jax's
persistent compilation cache (compile_cache.py), writing files whole and checking free space (files.py), and the one
progress display (progress.py)."""
