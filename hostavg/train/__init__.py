"""Training around the engine, framework-free: the fit loop, checkpoints, hooks, callbacks, History."""
