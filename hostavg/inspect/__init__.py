"""Looking at gradients after the fact: records, plots, TensorBoard (optional dependencies imported on use)."""
