"""Test-wide setup: 8 simulated CPU devices and hypothesis profiles.

XLA_FLAGS must be set before jax is imported anywhere, so it is set here, at
the top of the first module pytest imports.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile("default", deadline=None, max_examples=40, print_blob=True)
hypothesis.settings.register_profile("thorough", deadline=None, max_examples=400)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
