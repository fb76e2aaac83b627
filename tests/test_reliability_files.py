"""Damaged files: a seeded sample of single-bit flips of a real checkpoint and of a real record
step, and paths that cannot be written or are not paths. Every damaged file gives a HostavgError
naming it, or loads exactly what was written (a flip in a part of the zip nothing reads). Each
case once escaped as a raw exception (issue 24, item 9, and the unclear list)."""

import io
import struct
import zipfile

import numpy as np
import pytest
from models import batches, build, cuts, v1

import hostavg
from hostavg.hooks import Record
from hostavg.train import checkpoint
from hostavg.train.checkpoint import CheckpointDir

FLIPS = 600  # per file, besides every bit of one entry's zip headers (see flips)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(a checkpoint fit wrote, a record step with sparse and dense micro-batch gradients)."""
    folder = tmp_path_factory.mktemp("written")
    model = build(sparse=True)
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.AdamOptimizer(0.01),
                                  hooks=[Record(folder / "rec", micro=True)])
        init = v1.global_variables_initializer()
    with v1.Session(graph=model.graph) as sess:
        sess.run(init)
        data = batches(0, 1, 24, sparse=True)[0]
        trainer.fit(sess, model.feed(data), batch_size=24, micro_batch_size=8, epochs=1,
                    progress=False, checkpoint_dir=folder / "ckpt", seed=3)
    return CheckpointDir(folder / "ckpt").latest(), folder / "rec" / "step-0000000001.npz"


def flips(data: bytes, seed: int):
    """Bit positions to flip: a seeded sample of the file, and every bit of the zip structure of
    its first entry (local header, central directory entry) and of its end record, where one
    flip turns into the most kinds of exception."""
    rng = np.random.default_rng(seed)
    sample = set(rng.choice(8 * len(data), size=min(FLIPS, 8 * len(data)), replace=False).tolist())
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        first, central = z.infolist()[0].header_offset, z.start_dir
    # A local header: 30 bytes, then the name and the extra field, their lengths at 26 and 28;
    # a central directory entry: 46 bytes, then the name, extra field and comment (28, 30, 32).
    spans = [(first, 30 + sum(struct.unpack("<HH", data[first + 26:first + 30]))),
             (central, 46 + sum(struct.unpack("<HHH", data[central + 28:central + 34]))),
             (len(data) - 22, 22)]  # the end of central directory record
    structure = {8 * start + b for start, length in spans for b in range(8 * length)}
    return sorted(sample | structure)


def flipped(data: bytes, bit: int) -> bytes:
    out = bytearray(data)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def read_checkpoint(path, forms):
    stored, fit = checkpoint.read(path, forms)
    return {k: v.tobytes() + str(v.dtype).encode() for k, v in stored.items()}, fit


def read_record(path):
    record = hostavg.load_record(path.parent)
    step = record[record.steps[0]]
    out = {"meta": repr((step.step, step.loss, step.size, step.stats, step.micro, step.info,
                         step.update_ratios, step.learning_rate))}
    for prefix, grads in [("mean", step.mean)] + [(f"micro/{m['index']}",
                                                   step.micro_grads(m["index"]))
                                                  for m in step.micro]:
        for name, value in grads.items():
            arrays = (value.indices, value.values) if isinstance(value, hostavg.SparseGradient) \
                else (value,)
            out[f"{prefix}/{name}"] = b"".join(a.tobytes() + str(a.dtype).encode() + str(a.shape).encode()
                                               for a in arrays)
    return out


def each_flip(good: bytes, path, read, seed):
    """Flips each chosen bit of ``good`` into ``path`` and reads it: (bits refused, bits that
    loaded exactly, bits that escaped as another exception or loaded other values)."""
    want = read(path)
    refused, exact, wrong = 0, 0, []
    for bit in flips(good, seed):
        path.write_bytes(flipped(good, bit))
        try:
            got = read(path)
        except hostavg.HostavgError as e:
            if str(path) not in str(e):
                wrong.append((bit, f"HostavgError not naming the file: {e}"))
            refused += 1
            continue
        except Exception as e:  # noqa: BLE001 - what the test looks for
            wrong.append((bit, f"{type(e).__name__}: {e}"))
            continue
        if got != want:
            wrong.append((bit, "loaded other values"))
        else:
            exact += 1
    path.write_bytes(good)
    return refused, exact, wrong


def test_every_flipped_bit_of_a_checkpoint_is_refused_naming_it_or_loads_exactly(written, tmp_path):
    # 30 of 10,384 flips escaped as NotImplementedError ("That compression method is not
    # supported"), RuntimeError ("File ... is encrypted") or tokenize.TokenError.
    ckpt, _ = written
    good = ckpt.read_bytes()
    path = tmp_path / "ckpt-0000000001.npz"
    path.write_bytes(good)
    with np.load(path) as z:
        names = [k[len("var/"):] for k in z.files if k.startswith("var/")]
        forms = {n: (z[f"var/{n}"].shape, z[f"var/{n}"].dtype) for n in names}
    refused, exact, wrong = each_flip(good, path, lambda p: read_checkpoint(p, forms), seed=9)
    assert not wrong, wrong[:5]
    assert refused > 500 and exact > 0


def test_every_flipped_bit_of_a_record_step_is_refused_naming_it_or_loads_exactly(written, tmp_path):
    _, step = written
    good = step.read_bytes()
    path = tmp_path / "rec" / step.name
    path.parent.mkdir()
    path.write_bytes(good)
    refused, exact, wrong = each_flip(good, path, read_record, seed=10)
    assert not wrong, wrong[:5]
    assert refused > 500 and exact > 0


def test_a_record_array_whose_header_claims_fewer_values_is_damaged_not_short(written, tmp_path):
    # np.load stops after the values a header announces: a header shrunk from (50, 6) rows to
    # (10, 6) loaded 10 rows of a sparse gradient whose CRC was never checked.
    _, step = written
    path = tmp_path / "rec" / step.name
    path.parent.mkdir()
    with zipfile.ZipFile(step) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "mean/hidden/kernel.npy":
                data = data.replace(b"(6, 8)", b"(6, 2)")
            dst.writestr(info, data)
    record = hostavg.load_record(path.parent)
    with pytest.raises(hostavg.HostavgError, match=r"the record's file .*step-0000000001.npz is "
                       r"damaged \(ValueError: 'mean/hidden/kernel' holds bytes after the array "
                       r"its header describes\)"):
        record[1].mean


# --- Paths that are not paths, or cannot be written ---------------------------------------------


def linear():
    model = build()
    with model.graph.as_default():
        trainer = hostavg.Trainer(model.loss, v1.train.GradientDescentOptimizer(0.1))
        init = v1.global_variables_initializer()
    sess = v1.Session(graph=model.graph)
    sess.run(init)
    return model, trainer, sess


def test_save_to_none_or_an_unwritable_place_names_the_path_not_a_temporary(tmp_path):
    _, trainer, sess = linear()
    with pytest.raises(hostavg.HostavgError, match=r"^a checkpoint's path must be a file name "
                                                   r"\(str or os.PathLike\), got None$"):
        trainer.save(sess, None)
    with pytest.raises(hostavg.HostavgError, match=r"^cannot write the checkpoint '/proc/x.npz' "
                       r"\(No such file or directory\); name a file in a folder that can be "
                       r"written$"):
        trainer.save(sess, "/proc/x.npz")
    with pytest.raises(hostavg.HostavgError, match=r"^a checkpoint's path must be a file name"):
        trainer.restore(sess, None)
    (tmp_path / "f").write_text("a file")
    with pytest.raises(hostavg.HostavgError, match=r"^cannot write the checkpoint "
                                                   r"'.*/f/c.npz': '.*/f' is a file, not a folder$"):
        trainer.save(sess, tmp_path / "f" / "c.npz")
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


@pytest.mark.parametrize("path,match", [
    (None, r"^Record: path must be a folder name \(str or os.PathLike\), got None$"),
    ("FILE", r"^Record: path '.*/a-file' is a file, not a folder; name a folder for the record$"),
    ("UNDER_FILE", r"^Record: path '.*/a-file/rec' cannot be made \(Not a directory\); name a "
                   r"folder that can$"),
])
def test_record_refuses_a_path_that_is_no_folder_at_once(tmp_path, path, match):
    # Record(None) made a folder named "None"; Record(<a file>) raised FileExistsError.
    (tmp_path / "a-file").write_text("a file")
    path = {"FILE": tmp_path / "a-file", "UNDER_FILE": tmp_path / "a-file" / "rec"}.get(path, path)
    with pytest.raises(hostavg.HostavgError, match=match):
        Record(path)


@pytest.mark.parametrize("logdir,match", [
    (None, r"^TensorBoard: logdir must be a folder name \(str or os.PathLike\), got None$"),
    ("FILE", r"^TensorBoard: logdir '.*/a-file' is a file, not a folder; name a folder for the "
             r"event files$"),
])
def test_tensorboard_refuses_a_logdir_that_is_no_folder_at_once(tmp_path, logdir, match):
    # TensorBoard(<a file>) was accepted until the first apply.
    pytest.importorskip("tensorboard")
    (tmp_path / "a-file").write_text("a file")
    logdir = tmp_path / "a-file" if logdir == "FILE" else logdir
    with pytest.raises(hostavg.HostavgError, match=match):
        hostavg.hooks.TensorBoard(logdir)


def test_load_record_of_none_is_refused():
    with pytest.raises(hostavg.HostavgError, match=r"^load_record takes a record's folder \(str or "
                                                   r"os.PathLike\), got None$"):
        hostavg.load_record(None)
