"""What to do about each cause a failed check finds, and the words of a message, as a Keras 3 user says them.

Every Keras backend carries it as its ``advice`` (:class:`~hostavg.keras.common.CompiledModel`;
see :data:`hostavg.core.check.CAUSES` for what each cause means,
:data:`hostavg.core.words.WORDS` for each word).
"""

__all__ = ["ADVICE", "TRAIN_STEP_ADVICE"]

#: cause -> advice ("draw" is formatted with the name of a tensor drawn, ``{tensor}``), and
#: word -> the Keras word.
ADVICE = {
    "random": "hostavg computes with training=True, so keras.layers.Dropout (and other "
              "random layers) draw anew each run: check a model built with their rate 0, "
              "or expect each micro-batch to draw its own mask",
    "sampled": "A sampled loss draws its classes anew each run: check with the full loss, "
               "or expect each micro-batch to draw its own",
    "draw": "Noise drawn in the forward pass ({tensor!r}) differs each run: check a model "
            "that draws none, or expect each micro-batch to draw its own",
    "scale": "Use a keras.losses.Loss with reduction='sum_over_batch_size' (the default), "
             "or a loss function that returns the mean over the batch",
    "batch": "such as keras.layers.BatchNormalization, which in training normalises each "
             "micro-batch by its own statistics; or a loss over masked outputs (after "
             "Embedding(mask_zero=True) or Masking), which Keras averages over each "
             "micro-batch's own unmasked entries: weigh each micro-batch by its unmasked "
             "entries, step(batches, sizes=[...]), and the step is the full batch's",
    "fixed": "(keras.ops.reshape(x, (batch_size, ...)), keras.ops.ones((batch_size, ...)), "
             "an Input with batch_size=); use keras.ops.shape(x)[0], the rows the batch has, "
             "instead of batch_size",
    "no_samples": "check runs one batch whole and in micro-batches: give it x and y of at "
                  "least one sample each, such as x[:256], y[:256]",
    # The words of a message (hostavg.core.words.WORDS).
    "batch_name": "batch",
    "batches_name": "batches",
    "target_name": "model",
    "model_name": "model",
    "mean_op": "keras.ops.mean",
    "apply_reader": "the optimizer",
    "exact_random": "Keras's random layers keep their seed state in a variable of the model "
                    "(a keras.random.SeedGenerator), which checkpoints hold, and resume exactly",
}

#: The same for a model with its own ``train_step``, whose loss the step itself computes.
TRAIN_STEP_ADVICE = {
    **ADVICE,
    "scale": "The train_step's loss grows with the batch (a term summed over samples, such as "
             "a VAE's KL divergence summed over the batch): make it a mean over samples "
             "(keras.ops.mean), so that micro-batches average to the batch",
    "batch": "such as a train_step's loss with a term summed over the batch beside a mean (a "
             "VAE's KL divergence summed over samples: make it a mean), a loss that compares "
             "the samples of the batch with each other (a contrastive loss whose negatives are "
             "the batch's other samples: each micro-batch sees only its own), or "
             "keras.layers.BatchNormalization",
}
