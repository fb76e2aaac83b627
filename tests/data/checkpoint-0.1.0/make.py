"""Writes a checkpoint with hostavg 0.1.0 (positional History rows), for the format-1 reader's test."""
import shutil, sys
from pathlib import Path
sys.path.insert(0, "/work/main/tests")
import numpy as np
import hostavg
from models import FailAt, v1

from hostavg.cli import models as hm
tf = hostavg.import_tensorflow()
print(hostavg.__version__)
model = hm.mlp(10, [16], 3, seed=1)
with model.graph.as_default():
    trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01), accumulate="stack",
                              update_ratios_every=1, distributions_every=2,
                              hooks=[hostavg.hooks.ClipMicroBatchNorm(1.0), hostavg.hooks.ClipGlobalNorm(0.5)])
    init = v1.global_variables_initializer()
sess = v1.Session(graph=model.graph)
sess.run(init)
rng = np.random.default_rng(0)
x = rng.normal(size=(250, 10)).astype(np.float32)
data = {model.x: x, model.y: (x[:, 0] > 0).astype(np.int32)}
out = Path(sys.argv[1])
shutil.rmtree(out, ignore_errors=True)
try:
    trainer.fit(sess, data, batch_size=50, micro_batch_size=20, epochs=2, seed=3, progress=False,
                checkpoint_dir=out, callbacks=[FailAt(7)], keep_checkpoints=1)
except RuntimeError as e:
    print("stopped:", e)
print(sorted(p.name for p in out.iterdir()))
