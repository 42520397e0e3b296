"""Generation loops above models and runtime: greedy, EAGLE3 speculative, DI."""
