"""What to do about each cause a failed check finds, in the words of a TF1 program.

:class:`~hostavg.tf1.session.SessionBackend` carries it as its ``advice`` (see
:data:`hostavg.core.check.CAUSES` for what each cause means).
"""

__all__ = ["ADVICE"]

#: cause -> advice; "draw" is formatted with the name of a tensor drawn (``{tensor}``).
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
}
