"""What to do about each cause a failed check finds, and the words of a message, as a TF1 program says them.

:class:`~hostavg.tf1.session.SessionBackend` carries it as its ``advice`` (see
:data:`hostavg.core.check.CAUSES` for what each cause means, :data:`hostavg.core.words.WORDS`
for each word).
"""

__all__ = ["ADVICE", "advice_for"]

#: cause -> advice ("draw" is formatted with the name of a tensor drawn, ``{tensor}``), and
#: word -> the TF1 word.
ADVICE = {
    "random": "Turn them off for the check (a keep_prob or dropout-rate placeholder fed "
              "1.0 or 0.0, a training placeholder fed False) and check again",
    "sampled": "A sampled loss draws its classes anew each run, which no feed turns off: "
               "check with the full loss (such as tf.nn.sparse_softmax_cross_entropy_with_"
               "logits over every class), or expect each micro-batch to draw its own",
    "draw": "No feed turns them off: for the check, feed {tensor!r} a fixed array (one row "
            "per sample, such as zeros), which the check cuts with the rest of the feed, "
            "and check again; a step draws anew in each micro-batch",
    "scale": "Use the mean over the micro-batch's samples, tf.reduce_mean",
    "batch": "such as batch norm in training mode (tf.compat.v1.layers.batch_normalization "
             "with training=True)",
    "fixed": "(tf.reshape(x, [batch_size, ...]), tf.ones([batch_size, ...]), slices such as "
             "x[i * batch_size:(i + 1) * batch_size]); use tf.shape(x)[0], the rows the feed "
             "has, instead of batch_size",
    "no_samples": "check runs one batch whole and in micro-batches: feed it that batch's "
                  "arrays, such as {x: X[:256], y: Y[:256]}. A feed of scalars is one "
                  "sample; for a graph that reads its batch from a tf.data iterator or a "
                  "queue: feed the tensors it reads (the iterator's get_next() outputs, the "
                  "dequeued tensors) that batch's arrays, which leaves the iterator alone",
    # The words of a message (hostavg.core.words.WORDS).
    "batch_name": "feed dict",
    "batches_name": "feed dicts",
    "target_name": "session",
    "model_name": "graph",
    "mean_op": "tf.reduce_mean",
    "apply_reader": "the train op",
    "exact_random": "Stateless random ops (tf.random.stateless_*) seeded by the global step "
                    "resume exactly",
}


def advice_for(switches: dict) -> dict:
    """:data:`ADVICE`, naming the training-mode switches found (name -> the kinds it switches,
    "dropout" and "batch norm": :func:`hostavg.tf1.walk.switches`), and warning of one that
    switches both: turned off for dropout, it turns batch norm's training mode off too, which
    then passes the check unseen."""
    dropout = [name for name, kinds in switches.items() if "dropout" in kinds]
    norm = [name for name, kinds in switches.items() if "batch norm" in kinds]
    random, both = ADVICE["random"], [name for name in norm if name in dropout]
    if dropout:
        random = (f"Turn them off for the check: {_names(dropout)} switch"
                  f"{'es' if len(dropout) == 1 else ''} dropout here; feed {_them(dropout)} what "
                  f"turns it off (1.0 for a keep probability, 0.0 for a rate, False for a "
                  f"training flag) and check again")
    if both:
        random += (f". But {_names(both)} switch{'es' if len(both) == 1 else ''} batch norm too: "
                   f"fed that, batch norm uses its moving statistics, and a check that then "
                   f"passes says nothing of batch norm in training mode, which computes over the "
                   f"batch. To check it, give dropout a switch of its own (a rate placeholder fed "
                   f"0.0) and leave {_them(both)} in training mode")
    elif norm:
        random += (f". {_names(norm)} switch{'es' if len(norm) == 1 else ''} batch norm: leave "
                   f"{_them(norm)} in training mode, so that the check shows what batch norm "
                   f"changes")
    batch = f"{ADVICE['batch']}, here switched by {_names(norm)}" if norm else ADVICE["batch"]
    return {**ADVICE, "random": random, "batch": batch}


def _names(names: list) -> str:
    return ", ".join(map(repr, names))


def _them(names: list) -> str:
    return "it" if len(names) == 1 else "them"
