"""The record (the Record hook, hostavg.inspect.record and load_record): a damaged step file
named while the other steps stay readable, paths that are no folder refused, its tables' arguments
checked."""

import zipfile

import pytest
from models import dead_pid, each_flip, recorded_step, tf1, written
from test_trainer import Case

import hostavg
from hostavg.hooks import Record


# --- A damaged file is named; the other steps stay readable -----------------------------------


def test_a_damaged_record_file_is_named_and_the_other_steps_stay_readable(tmp_path):
    case = Case(hooks=[Record(tmp_path / "rec")])
    for _ in range(3):
        case.trainer.step(case.sess, case.feeds)
    step2 = tmp_path / "rec" / "step-0000000002.npz"
    step2.write_bytes(step2.read_bytes()[:200])
    stale = tmp_path / "rec" / f".step-0000000004.npz.{dead_pid()}.ab.tmp"
    stale.write_bytes(b"half")
    record = hostavg.load_record(tmp_path / "rec")
    assert record.steps == [1, 2, 3]
    for step in (1, 3):
        assert record[step].mean.keys() == case.trainer.spec.keys()
    with pytest.raises(hostavg.HostavgError, match=r"the record's file .*step-0000000002.npz is "
                       r"damaged \(BadZipFile: .*\); the other steps stay readable"):
        record[2]
    with pytest.raises(hostavg.HostavgError, match="step-0000000002.npz is damaged"):
        record.to_pandas()
    Record(tmp_path / "rec")  # a new writer clears what a killed one left
    assert not stale.exists()


# --- The tables' arguments --------------------------------------------------------------------


def test_record_tables_refuse_a_micro_that_is_no_bool(tmp_path, tf1):
    model, _, _, feed = tf1
    recorded_step(model, feed, tmp_path / "rec")
    record = hostavg.load_record(tmp_path / "rec")
    with pytest.raises(hostavg.HostavgError, match=r"^micro must be True or False, got 'False'$"):
        record.variable_norms(micro="False")


# --- Every flipped bit is refused naming the file, or loads exactly ---------------------------


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


def test_load_record_of_none_is_refused():
    with pytest.raises(hostavg.HostavgError, match=r"^load_record takes a record's folder \(str or "
                                                   r"os.PathLike\), got None$"):
        hostavg.load_record(None)
