"""The command line: the main job's numbers, and one-line errors for a person's mistakes."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hostavg.cli import main
from hostavg.cli.main import SUMMARY


def test_train_on_digits_writes_a_json_summary_above_the_accuracy_bar(tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert main(["train", "--dataset", "digits", "--epochs", "6", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert list(summary) == list(SUMMARY)  # what --json's help lists
    assert summary["test_accuracy"] > 0.85, summary
    assert summary["steps"] == 6 * 6 and summary["samples"] == 6 * 1438
    assert summary["self_check"] is True
    printed = capsys.readouterr().out
    assert "epoch 6/6: loss" in printed and "test accuracy" in printed.splitlines()[-1]
    assert printed.splitlines()[1].startswith("self-check passed: 8 micro-batches give the whole "
                                              "batch's gradient")


def test_train_with_the_keras_engine_gives_the_tf1_report(tmp_path, capsys):
    args = ["train", "--dataset", "digits", "--epochs", "2"]
    assert main([*args, "--engine", "keras", "--json", str(tmp_path / "keras.json")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("hostavg train (Keras engine): digits, 1438 training and 359 test")
    assert "epoch 2/2: loss" in printed and "test accuracy" in printed.splitlines()[-1]
    assert main([*args, "--quiet", "--json", str(tmp_path / "tf1.json")]) == 0
    keras, tf1 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("keras", "tf1"))
    assert keras.keys() == tf1.keys()
    assert (keras["steps"], keras["samples"]) == (tf1["steps"], tf1["samples"]) == (12, 2 * 1438)
    # The same MLP from the same weights, and Adam's same update: the same training, to round-off.
    assert keras["test_loss"] == pytest.approx(tf1["test_loss"], abs=1e-4)
    assert keras["test_accuracy"] == pytest.approx(tf1["test_accuracy"], abs=0.01)


def one_line_error(capsys, argv, match):
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(main(argv))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert match in err, err


def test_mistakes_exit_2_with_one_line(tmp_path, capsys):
    one_line_error(capsys, ["train", "--batch-size", "16", "--micro-batch-size", "32"],
                   "hostavg train: error: micro_batch_size (32) is larger than batch_size (16)")
    one_line_error(capsys, ["train", "--optimizer", "lamb"],
                   "hostavg train: error: argument --optimizer: invalid choice: 'lamb'")
    one_line_error(capsys, ["train", "--hidden", "0"], "expected layer widths (integers >= 1)")
    one_line_error(capsys, ["bench", "--models", "resnet"], "unknown model ['resnet']")
    one_line_error(capsys, ["train", "--engine", "keras", "--average", "graph"],
                   "--average graph is for the TF1 engine")
    ckpt = str(tmp_path / "ck")
    assert main(["train", "--dataset", "digits", "--epochs", "1", "--quiet", "--hidden", "16",
                 "--checkpoint-dir", ckpt]) == 0
    capsys.readouterr()
    one_line_error(capsys, ["train", "--dataset", "digits", "--hidden", "32", "--checkpoint-dir", ckpt],
                   "was written by a different model")


@pytest.mark.slow
def test_console_script_is_installed():
    # Next to this Python first: `python -m pip` installs scripts there even where that
    # folder is not on PATH (pyenv without a rehash, say).
    exe = shutil.which("hostavg", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    assert exe, "no hostavg console script next to this Python or on PATH; pip install -e ."
    # As a user's shell starts it: TensorFlow's log level unset, so hostavg quiets it.
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    run = subprocess.run([exe, "train", "--dataset", "digits", "--epochs", "1", "--quiet"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("test accuracy ")
    assert run.stderr == "", run.stderr  # no TensorFlow start-up lines


def test_a_path_that_cannot_be_written_is_refused_before_training(tmp_path, capsys):
    import time
    t0 = time.perf_counter()
    one_line_error(capsys, ["train", "--dataset", "digits", "--json", "/nonexistent/x.json"],
                   "hostavg train: error: argument --json: the folder '/nonexistent' of "
                   "'/nonexistent/x.json' does not exist")
    one_line_error(capsys, ["train", "--json", str(tmp_path)], "is a folder; name a file")
    (tmp_path / "file").write_text("")
    one_line_error(capsys, ["train", "--checkpoint-dir", str(tmp_path / "file")],
                   "--checkpoint-dir")
    one_line_error(capsys, ["train", "--checkpoint-dir", str(tmp_path / "file" / "ck")],
                   "is not a writable folder")
    one_line_error(capsys, ["bench", "--json", "/nonexistent/b.json"], "does not exist")
    one_line_error(capsys, ["train", "--checkpoint-every", "5"],
                   "hostavg train: error: --checkpoint-every 5 needs --checkpoint-dir, the folder "
                   "to write the checkpoints to")
    assert time.perf_counter() - t0 < 5  # refused before TensorFlow and the data load


def test_version_and_help_for_every_option(capsys):
    from hostavg import __version__
    from hostavg.cli.main import _parser
    for argv in (["--version"], ["train", "--version"], ["bench", "--version"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0 and capsys.readouterr().out == f"hostavg {__version__}\n"
    parser = _parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in [("hostavg", parser), *commands.items()]:
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{name} {action.option_strings[0]} has no help"
        text = sub.format_help()
        assert "%%" not in text and "%(" not in text, name
    train_help = " ".join(commands["train"].format_help().split())
    assert "20% test split" in train_help
    assert all(key in train_help for key in SUMMARY), train_help  # --json names every key
    assert "smallest (a smoke test" in " ".join(commands["bench"].format_help().split())


def test_one_display_per_epoch_under_the_historys_names(tmp_path, capsys, monkeypatch):
    argv = ["train", "--dataset", "digits", "--epochs", "2", "--hidden", "16"]
    assert main(argv) == 0  # not a terminal: one line per epoch
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and "val_loss" in lines[0] and "val_accuracy" in lines[0], lines
    assert all(re.search(r"\(took \d+\.\d\d s; \d+\.\d\d s in all\)$", line) for line in lines), lines
    assert "test loss" not in lines[0] and out.err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: the bar alone
    assert main(argv) == 0
    out = capsys.readouterr()
    assert not [line for line in out.out.splitlines() if line.startswith("epoch ")]
    assert "epoch 2/2: 100%" in out.err and "val_loss=" in out.err and "val_accuracy=" in out.err


@pytest.mark.slow  # fresh TensorFlow processes
def test_the_tensorflow_import_prints_nothing_unless_asked():
    code = ("import hostavg\n"
            "tf = hostavg.import_tensorflow()\n"
            "g = tf.Graph()\n"
            "with g.as_default():\n"
            "    c = tf.constant(2.0)\n"
            "print(tf.compat.v1.Session(graph=g).run(c))\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=Path(__file__).parents[1])
    assert run.returncode == 0 and run.stdout == "2.0\n" and run.stderr == "", run.stderr


def test_resuming_says_from_where_and_a_finished_run_says_so(tmp_path, capsys):
    ckpt = tmp_path / "ck"
    argv = ["train", "--dataset", "digits", "--hidden", "16", "--checkpoint-dir", str(ckpt)]
    assert main([*argv, "--epochs", "1"]) == 0
    assert "resumed" not in capsys.readouterr().out
    assert main([*argv, "--epochs", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"resumed from {ckpt / 'ckpt-0000000006.npz'} at global step 6\n" in printed, printed
    assert "epoch 2/2: loss" in printed and "nothing left" not in printed
    assert main([*argv, "--epochs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "after 12 steps" in printed
    assert "nothing left to train: the checkpoint's run had finished 2 epochs (--epochs 2)" in printed
    assert main([*argv, "--epochs", "1"]) == 0
    assert "the checkpoint's run had finished 2 epochs (--epochs 1)" in capsys.readouterr().out


def test_ctrl_c_says_where_the_checkpoint_is(tmp_path, capsys, monkeypatch):
    from hostavg.cli.main import _EpochPrinter

    def interrupt(self, epoch, logs):
        raise KeyboardInterrupt
    monkeypatch.setattr(_EpochPrinter, "on_epoch_end", interrupt)  # Ctrl-C after epoch 1's steps
    ckpt = tmp_path / "ck"
    argv = ["train", "--dataset", "digits", "--hidden", "16", "--epochs", "2"]
    assert main([*argv, "--checkpoint-dir", str(ckpt)]) == 130
    err = capsys.readouterr().err
    assert err == (f"hostavg train: interrupted; {ckpt / 'ckpt-0000000006.npz'} holds the last "
                   f"completed step: run the same command to resume from it\n"), err
    assert main(argv) == 130
    assert capsys.readouterr().err == ("hostavg train: interrupted; nothing was saved (with "
                                       "--checkpoint-dir, the same command resumes a run)\n")
    monkeypatch.undo()
    assert main([*argv, "--checkpoint-dir", str(ckpt)]) == 0
    assert "resumed from" in capsys.readouterr().out


def test_stack_mode_shows_the_statistics_it_enables(tmp_path, capsys):
    out = tmp_path / "summary.json"
    assert main(["train", "--dataset", "digits", "--hidden", "16", "--epochs", "1",
                 "--accumulate", "stack", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"last step \(6\), from every micro-batch's gradients: cosine with the mean "
                    r"-?\d\.\d\d to -?\d\.\d\d over its 5 micro-batches; inner-product test "
                    r"\S+, orthogonality test \S+ \(above 1: too noisy to trust at this batch "
                    r"size\); GSNR \S+$", lines[-2]), lines[-2]
    assert lines[-1].startswith("test accuracy")
    last = json.loads(out.read_text())["last_step"]
    assert last.keys() == {"step", "cosines", "inner_product_test", "orthogonality_test", "gsnr"}
    # 1,438 samples: the epoch's last batch holds 158, 5 micro-batches of up to 32
    assert last["step"] == 6 and len(last["cosines"]) == 5


def test_a_json_path_that_refuses_a_new_file_is_refused_before_training(capsys):
    # /proc passes the folder checks (it exists, root may write it) but takes no new file: the
    # run trained, then ended with a FileNotFoundError traceback and the summary lost.
    one_line_error(capsys, ["train", "--dataset", "digits", "--json", "/proc/x.json"],
                   "hostavg train: error: argument --json: '/proc/x.json' cannot be written (No "
                   "such file or directory)")


def test_a_json_summary_that_cannot_be_written_after_all_is_printed(tmp_path, capsys, monkeypatch):
    out = tmp_path / "summary.json"

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")
    argv = ["train", "--dataset", "digits", "--epochs", "1", "--quiet", "--json", str(out)]
    monkeypatch.setattr(Path, "write_text", full)  # the disk fills up while training
    assert main(argv) == 1
    captured = capsys.readouterr()
    printed = json.loads(captured.out[captured.out.index("{"):])
    assert printed["steps"] == 6 and 0 <= printed["test_accuracy"] <= 1
    assert captured.err.strip().splitlines()[-1] == (
        f"hostavg train: error: cannot write --json {out} (No space left on device); the results "
        f"are printed above")
    assert not out.exists()


@pytest.mark.parametrize("engine", ["tf1", "keras"])
def test_record_and_tensorboard_hold_every_step_of_the_run(engine, tmp_path, capsys):
    from tensorboard.backend.event_processing import event_accumulator as ea

    import hostavg
    rec, tb = tmp_path / "rec", tmp_path / "tb"
    argv = ["train", "--dataset", "digits", "--epochs", "2", "--hidden", "16", "--engine", engine,
            "--record", str(rec), "--tensorboard", str(tb), "--json", str(tmp_path / "s.json")]
    assert main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:3] == [f"recording every step in {rec} (read it with hostavg.load_record)",
                            f"TensorBoard: tensorboard --logdir {tb}"]
    steps = json.loads((tmp_path / "s.json").read_text())["steps"]
    record = hostavg.load_record(rec)
    assert record.steps == list(range(1, steps + 1)) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert not record[1].micro[0]["recorded"]  # micro-batch gradients: only with --record-micro
    reader = ea.EventAccumulator(str(tb)).Reload()
    losses = reader.Scalars("hostavg/loss")
    assert [e.step for e in losses] == record.steps
    assert [e.value for e in losses] == pytest.approx([record[s].loss for s in record.steps],
                                                      rel=1e-6)
    assert [e.step for e in reader.Scalars("epoch/val_accuracy")] == [6, 12]
    # Run again into the same record: refused before training, unless resuming.
    one_line_error(capsys, argv, f"--record {str(rec)!r} already holds 12 steps of another run")
    # A run resumed from its checkpoints continues its record; --record-micro keeps micro-batches.
    def again(epochs):
        return main(["train", "--dataset", "digits", "--epochs", epochs, "--hidden", "16",
                     "--engine", engine, "--record", str(tmp_path / "rec2"), "--record-micro",
                     "--checkpoint-dir", str(tmp_path / "ck"), "--quiet"])
    assert again("1") == 0 and again("2") == 0
    resumed = hostavg.load_record(tmp_path / "rec2")
    assert resumed.steps == record.steps and resumed[12].micro[0]["recorded"]
    capsys.readouterr()
    one_line_error(capsys, ["train", "--record-micro"], "--record-micro records each "
                                                        "micro-batch's gradients into the record: "
                                                        "it needs --record DIR")


# --- The command line: one line, exit status 2, before any training -----------------------------


def one_line(capsys, argv, match):
    from hostavg.cli import main
    with pytest.raises(SystemExit) as exit_:
        raise SystemExit(main(argv))
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err, err


def test_command_line_mistakes_are_one_line_before_any_training(tmp_path, capsys):
    train = ["train", "--dataset", "digits", "--epochs", "1", "--quiet"]
    a_file = tmp_path / "file"
    a_file.write_text("")
    one_line(capsys, [*train, "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'")
    one_line(capsys, [*train, "--checkpoint-dir", str(a_file)],
             f"hostavg train: error: --checkpoint-dir '{a_file}' is a file, not a folder")
    one_line(capsys, [*train, "--checkpoint-dir", str(a_file / "sub")],
             f"--checkpoint-dir '{a_file / 'sub'}': '{a_file}' is not a writable folder")
    one_line(capsys, [*train, "--hidden", "1000000000"],
             "hostavg train: error: --hidden 1000000000 makes an MLP of 75,000,000,010 parameters, "
             "which needs about")
    one_line(capsys, [*train, "--lr", "inf"], "--lr must be a finite number > 0, got inf")
    for command in (train, ["bench"]):
        one_line(capsys, [*command, "--json", str(tmp_path / "missing" / "out.json")],
                 f"argument --json: the folder '{tmp_path / 'missing'}' of")
    one_line(capsys, [*train, "--json", str(tmp_path)], "is a folder; name a file")
