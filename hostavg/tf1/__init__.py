"""The TF1 backend: a ``tf.compat.v1`` graph and its session (imports TensorFlow)."""
