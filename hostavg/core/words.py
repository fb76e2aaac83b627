"""The words a message of the framework-free layers takes from its backend, where frameworks differ.

A message of ``core``, ``engine``, ``train`` or ``inspect`` says "batch",
"micro-batch", "data" and "model"; where a user of one framework reads a word
of their own (a TF1 program's feed dicts and session, a Keras model's
batches), the message takes it from the backend's advice
(:attr:`Backend.advice <hostavg.engine.protocols.Backend.advice>`), which
maps every key of :data:`WORDS` beside the check's causes.
"""

__all__ = ["WORDS"]

#: The words, each a key of every backend's advice, mapped to its framework's word for:
#: "batch_name", one batch as the face takes it (a TF1 feed dict, a Keras batch);
#: "batches_name", the same, plural; "target_name", what holds the variables' values
#: (``Backend.target``: a session, a model); "model_name", what defines the computation (a
#: graph, a model); "mean_op", what reduces a loss over the samples to their mean;
#: "apply_reader", what reads the inputs an apply is fed (``Backend.apply_feed``);
#: "exact_random", a sentence: which random ops a resumed fit draws as one never stopped.
#: A message uses them as in "pass at least one {batch_name}".
WORDS = ("batch_name", "batches_name", "target_name", "model_name", "mean_op", "apply_reader",
         "exact_random")
