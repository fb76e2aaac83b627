"""per_sample in chunks (many samples per call where the framework vectorizes, two passes):
the same table as each sample computed alone, whatever the chunk size."""

import numpy as np
import pytest
from backends import BATCH, SIZES, same
from models import batches

import hostavg

COLUMNS = ["loss", "norm", "cosine", "cosine_to_rest"]


def brute_force(face, data) -> np.ndarray:
    """(n, 4) loss, norm, cosine and cosine to the rest of each sample, from each computed
    alone (``face.compute`` of a batch of one) and the cosines in float64 by brute force."""
    alone = [face.compute(m) for m in face.cut(data, 1)]
    flat = np.array([np.concatenate([np.ravel(g[name]) for name in face.trainer.spec])
                     for g in alone], np.float64)
    mean, out = flat.mean(axis=0), []
    for i, (g, f) in enumerate(zip(alone, flat)):
        rest = np.delete(flat, i, axis=0).mean(axis=0)
        norm = np.linalg.norm(f)
        out.append([g.loss, norm, f @ mean / (norm * np.linalg.norm(mean)),
                    f @ rest / (norm * np.linalg.norm(rest))])
    return np.array(out)


@pytest.mark.parametrize("model", ["mlp", "batchnorm"])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_per_sample_in_chunks_is_each_sample_alone_and_changes_nothing(backend, model,
                                                                       chunk_size):
    face = backend.make(model)
    data = batches(9, 2, BATCH)
    face.step(face.cut(data[0], SIZES))  # moving statistics away from their start
    sample = {k: v[:13] for k, v in data[1].items()}  # chunks of 5: 5, 5 and 3
    before = face.values()
    table = face.per_sample(sample, chunk_size=chunk_size)
    same(face.values(), before)  # moving statistics and the counter too
    assert table["error"].isna().all()
    np.testing.assert_allclose(table[COLUMNS].to_numpy(float), brute_force(face, sample),
                               rtol=1e-6, atol=1e-6)


def test_a_nan_sample_is_left_out_of_the_means_in_every_chunk_size(backend):
    """Its loss and norm NaN, its cosines NaN; the others' as without it."""
    face = backend.make()
    data = {k: v[:9] for k, v in batches(9, 1, BATCH)[0].items()}
    without = face.per_sample({k: np.delete(v, 4, axis=0) for k, v in data.items()})
    data["x"][4, 1] = np.nan
    for chunk_size in (2, 9):
        table = face.per_sample(data, chunk_size=chunk_size)
        assert table.loc[4, COLUMNS].isna().all()
        np.testing.assert_allclose(table.drop(index=4)[COLUMNS].to_numpy(float),
                                   without[COLUMNS].to_numpy(float), rtol=1e-6, atol=1e-6)


def test_a_refused_sample_has_the_same_row_in_every_chunk_size(backend):
    """A target out of range in the second of three chunks: its row says why as it would
    alone; the others compute (together) as without it."""
    face = backend.make()
    data = {k: v[:7] for k, v in batches(9, 1, BATCH)[0].items()}
    data["y"][3] = 7  # of 3 classes
    alone = face.per_sample(data, rows=np.arange(20, 27), chunk_size=1)
    for chunk_size in (3, 7):
        table = face.per_sample(data, rows=np.arange(20, 27), chunk_size=chunk_size)
        assert table.loc[23, "error"] == alone.loc[23, "error"]
        assert "data row 23" in table.loc[23, "error"] and "7" in table.loc[23, "error"]
        assert table["error"].drop(index=23).isna().all()
        np.testing.assert_allclose(table[COLUMNS].to_numpy(float),
                                   alone[COLUMNS].to_numpy(float), rtol=1e-6, atol=1e-6)


def test_chunk_size_must_be_a_positive_integer(backend):
    face = backend.make()
    with pytest.raises(hostavg.ArgumentError, match="chunk_size must be"):
        face.per_sample(batches(9, 1, 4)[0], chunk_size=0)
