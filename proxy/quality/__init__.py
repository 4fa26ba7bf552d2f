"""Live reward quality: per (run, backend, task), how the reward agrees with the simulator's success
over a rolling window, and the reward-hacking alarm (window.py: the rule; monitor.py: the keys,
metrics, audit lines and warnings)."""
