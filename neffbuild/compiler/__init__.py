"""Build pipeline: backends, the compile cache, the worker pool, and targets -> bundle."""
