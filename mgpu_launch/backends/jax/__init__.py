"""The jax backend: everything mgpu needs of it, in one folder."""
