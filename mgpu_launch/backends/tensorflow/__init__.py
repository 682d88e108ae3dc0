"""The tensorflow backend: everything mgpu needs of it, in one folder."""
