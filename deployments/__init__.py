"""Ray Serve deployments and batch jobs around the engine.

The engine is imported first (torch-free at this point) so that it bounds torch's OpenMP
spinning before anything here loads torch (engine/cpu/spin.py): a replica given more than one
torch thread (``serving.torch_threads``) shares its CPU kernels' work among them."""

import engine  # noqa: F401
