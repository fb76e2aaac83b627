"""The framework-free core: gradient values, the accumulator, splitting, statistics, results, errors.

NumPy only: nothing here imports TensorFlow, Keras, JAX or torch.
"""
