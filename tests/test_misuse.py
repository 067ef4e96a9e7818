"""Misuse is refused with one clear error that names the culprit, the value given and what was expected.

Covers the Python API (checker arguments, variable shapes, operator inputs, the trainer) and the
``opgrad`` command, where a user error is one ``opgrad <cmd>: error: ...`` line and no traceback.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import opgrad
from opgrad import checkpoint, cli, nn, ops
from opgrad.checkpoint import CheckpointError, atomic_writer, load_checkpoint, save_checkpoint
from opgrad.checks import NothingToCheckError, check_function, check_op, check_ops
from opgrad.data import DataError, load_mnist_dir

ROOT = Path(__file__).resolve().parents[1]
#: A tiny, fast training run: reference backend, two steps of 8 digits, 40 test digits.
SMOKE = ["train", "--backend", "reference", "--batch-size", "8", "--max-steps", "2", "--test-limit", "40",
         "--epochs", "1"]

# ----- opgrad.checks -----


def test_unknown_check_letters_are_named_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown check letter\(s\) 'x', 'y', 'z' in checks='xyz'") as info:
        check_op("relu", checks="xyz")
    assert "valid letters are 'abcdefg'" in str(info.value) and "a: gradient shape and dtype" in str(info.value)
    with pytest.raises(ValueError, match=r"unknown check letter.*'A'"):
        check_op("relu", checks="A")
    with pytest.raises(ValueError, match="selects no check"):
        check_op("relu", checks="")


def test_checks_accepts_letters_in_any_order_and_as_a_list() -> None:
    assert check_op("relu", checks="gfa", max_examples=2, seed=0).checks == ["a", "f", "g"]
    assert check_op("relu", checks=["b", "a"], max_examples=2, seed=0).checks == ["a", "b"]


def test_a_subset_that_does_not_apply_is_refused_not_reported_as_passed() -> None:
    with pytest.raises(NothingToCheckError, match=r"none of checks='d' applies to relu; .* 'abcefg'"):
        check_op("relu", checks="d")
    reports = check_ops(["relu", "one_hot"], checks="ab", max_examples=2, seed=0)
    assert reports[0].checks == ["a", "b"]
    assert reports[1].checks == [] and "nothing to check" in reports[1].notes[0]
    with pytest.raises(NothingToCheckError):
        check_ops(["one_hot", "greater"], checks="ab", max_examples=2, seed=0)


@pytest.mark.parametrize(("kwargs", "error", "words"), [
    ({"max_examples": 0}, ValueError, "max_examples must be a positive integer, got 0"),
    ({"max_examples": 2.5}, TypeError, "max_examples must be a positive integer, got float 2.5"),
    ({"seed": -1}, ValueError, "seed must be a non-negative integer or None, got -1"),
    ({"backend": 3}, TypeError, "backend must be one of 'reference', 'llvm' or a callable"),
    ({"backend": "cuda"}, ValueError, "unknown backend 'cuda'"),
    ({"gradient": "mine"}, TypeError, "gradient must be a rule"),
])
def test_check_op_arguments_are_validated(kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_op("relu", **kwargs)


def _xy() -> tuple[opgrad.Var, opgrad.Var, opgrad.Function]:
    x, y = opgrad.var("x", (3,), "float64"), opgrad.var("y", (3,), "float64")
    return x, y, opgrad.function([x, y], ops.sum(x * y))


def test_check_function_names_the_parameter_and_the_expected_and_given_arrays() -> None:
    _, _, fn = _xy()
    with pytest.raises(opgrad.ArgumentError, match=r"expected 2 array\(s\), one per parameter "
                                                   r"\(x: float64\[3\], y: float64\[3\]\), got 1"):
        check_function(fn, [np.zeros(3)])
    with pytest.raises(opgrad.ArgumentError, match=r"parameter 'y' expects shape \(3,\) \(float64\[3\]\), "
                                                   r"got an array of shape \(4,\)"):
        check_function(fn, [np.zeros(3), np.zeros(4)])
    with pytest.raises(opgrad.ArgumentError, match=r"parameter 'x' is float64\[3\] and expects float values, "
                                                   r"got an array of dtype int64"):
        check_function(fn, [np.zeros(3, np.int64), np.zeros(3)])
    with pytest.raises(opgrad.ArgumentError, match="one array per parameter"):
        check_function(fn, np.zeros((2, 3)))
    labels = opgrad.var("labels", (2,), "int32")
    logits = opgrad.var("logits", (2, 4), "float64")
    loss_fn = opgrad.function([logits, labels], ops.softmax_cross_entropy(logits, labels))
    with pytest.raises(opgrad.ArgumentError, match=r"parameter 'labels' is int32\[2\] and expects integer values"):
        check_function(loss_fn, [np.zeros((2, 4)), np.zeros(2)])
    with pytest.raises(opgrad.ArgumentError, match="do not fit in int32"):
        check_function(loss_fn, [np.zeros((2, 4)), np.array([0, 2**40])])
    # float precision does not matter (the check runs in float64); plain int lists fit int params
    assert check_function(fn, [np.ones(3, np.float32), np.ones(3)], seed=0).passed
    assert check_function(loss_fn, [np.zeros((2, 4)), [0, 3]], seed=0).passed


def test_check_function_with_nothing_differentiable_says_so_instead_of_passing() -> None:
    x, _, fn = _xy()
    with pytest.raises(NothingToCheckError, match=r"nothing to check: function has no differentiable parameter.*"
                                                  r"wrt=\[\] selects no parameter"):
        check_function(fn, wrt=[])
    labels = opgrad.var("labels", (3,), "int64")
    with pytest.raises(NothingToCheckError, match="it has no float parameter"):
        check_function(opgrad.function([labels], ops.sum(ops.one_hot(labels, depth=4))), [np.arange(3)])
    with pytest.raises(NothingToCheckError, match="does not depend differentiably on 'x'"):
        check_function(opgrad.function([x], ops.sum(ops.zeros_like(x))))
    with pytest.raises(ValueError, match=r"output is int64\[3\]; only a float output has a gradient"):
        check_function(opgrad.function([labels], labels), [np.arange(3)])


def test_check_function_wrt_accepts_the_functions_own_variables() -> None:
    x, _, fn = _xy()
    assert check_function(fn, wrt=[x], seed=0, max_examples=2).passed
    assert check_function(fn, wrt="y", seed=0, max_examples=2).passed


# ----- variable shapes -----


@pytest.mark.parametrize(("shape", "error", "words"), [
    ((2.5, 3), opgrad.DimensionTypeError, "shape (2.5, 3): dimension 0 is float 2.5; dimensions must be integers"),
    ((3.0,), TypeError, "dimension 0 is float 3.0"),
    ((True, 3), TypeError, "dimension 0 is bool True"),
    ((2, "3"), TypeError, "dimension 1 is str '3'"),
    ((4, -1), ValueError, "shape (4, -1): dimension 1 is -1; dimensions must be >= 0"),
    ("ab", TypeError, "shape must be a sequence of integers such as (2, 3), got str 'ab'"),
    (None, TypeError, "got NoneType None"),
    ((2**62, 4), opgrad.ShapeError, "has 18446744073709551616 elements; a float32 tensor may have at most "
                                    "2305843009213693951 (its size in bytes and its strides must fit in int64)"),
    ((2**63,), ValueError, "has 9223372036854775808 elements"),
    ((2**62, 4, 0), ValueError, "non-zero dimensions multiplying to 18446744073709551616"),
])
def test_var_refuses_bad_dimensions_naming_the_variable(shape: object, error: type, words: str) -> None:
    with pytest.raises(error) as info:
        opgrad.var("x", shape)  # type: ignore[arg-type]
    assert str(info.value).startswith("opgrad.var('x'): ") and words in str(info.value)


def test_var_accepts_python_and_numpy_integers_and_zero_sizes() -> None:
    assert opgrad.var("x", (np.int32(2), np.int64(3), 4)).shape == (2, 3, 4)
    assert opgrad.var("x", np.array([2, 3])).shape == (2, 3)
    assert opgrad.var("x", 5).shape == (5,)  # a single integer is a 1-D shape, as in numpy
    assert opgrad.var("x", (0, 3)).type.size == 0
    assert opgrad.var("x", (2**30, 2**30), "float32").type.size == 2**60  # exact, no int64 wrap-around
    with pytest.raises(TypeError, match=r"opgrad.var\('x'\): unsupported dtype 'float16'"):
        opgrad.var("x", (2,), "float16")


# ----- operator inputs -----


@pytest.mark.parametrize(("value", "given"), [
    ("hello", "got str 'hello'"),
    (None, "got NoneType None"),
    ({"a": 1}, "got dict {'a': 1}"),
    (object(), "got object <object object at"),
    ([[1.0], [2.0, 3.0]], "got list [[1.0], [2.0, 3.0]] (setting an array element"),
])
def test_a_non_numeric_op_input_names_the_op_and_the_input(value: object, given: str) -> None:
    with pytest.raises(opgrad.OpInputTypeError) as info:
        ops.relu(value)
    message = str(info.value)
    assert message.startswith("opgrad.ops.relu: input 'data' must be an opgrad expression or a numeric "
                              "array/scalar, ") and given in message
    assert isinstance(info.value, TypeError) and isinstance(info.value, opgrad.OpCallError)


def test_other_op_input_mistakes_name_the_op_and_the_input() -> None:
    x = opgrad.var("x", (3,))
    with pytest.raises(TypeError, match=r"opgrad.ops.add: input 'rhs' must be .*, got str 'a'"):
        _ = x + "a"
    with pytest.raises(TypeError, match=r"'@': right operand must be .*, got str 'a'"):
        _ = opgrad.var("m", (2, 3)) @ "a"
    with pytest.raises(TypeError, match=r"opgrad.ops.relu: input 'data' has dtype complex128, which opgrad does "
                                        r"not support \(expected one of float32, float64, int32, int64\)"):
        ops.relu(1 + 2j)
    with pytest.raises(TypeError, match=r"opgrad.ops.one_hot: input 'labels' takes integers \(int32 or int64\), "
                                        r"got list \[0.5, 1.0\]"):
        ops.one_hot([0.5, 1.0], depth=3)
    with pytest.raises(TypeError, match=r"got an opgrad\.Function; pass one of its expressions"):
        ops.relu(opgrad.function([x], x))
    with pytest.raises(opgrad.OpCallError, match=r"inputs: float32\[3\], float32\[3\], str 'a'\n.*\n"
                                                 r"  problem: expected 2 input\(s\) \(lhs, rhs\), got 3"):
        ops.add(x, x, "a")
    with pytest.raises(TypeError, match=r"opgrad\.const: value must be a numeric array or scalar, got str 's'"):
        opgrad.const("s")
    # numbers, lists and numpy values still work, with numpy's dtypes
    assert ops.add(x, 2).dtype == "float32" and ops.relu([1.0, 2.0]).shape == (2,)
    assert ops.one_hot(np.array([0, 2], np.int32), depth=3).shape == (2, 3)


@pytest.mark.parametrize("transform", [opgrad.grad, opgrad.hvp, opgrad.jvp])
def test_differentiating_an_expression_instead_of_a_function_says_what_to_pass(transform: object) -> None:
    x = opgrad.var("x", (3,))
    with pytest.raises(TypeError, match=r"takes an opgrad.Function, got Call .*opgrad.function"):
        transform(ops.sum(x * x))  # type: ignore[operator]


def test_evaluate_names_the_argument_given_a_non_numeric_value() -> None:
    x = opgrad.var("x", (2,))
    fn = opgrad.function([x], ops.relu(x))
    with pytest.raises(opgrad.ArgumentError, match=r"opgrad.evaluate: argument 'x' must be a numeric array "
                                                   r"\(float32\[2\]\), got str 'hello'$"):
        opgrad.evaluate(fn, "hello")
    with pytest.raises(opgrad.ArgumentError, match=r"argument .x. must be a numeric array .* got list \[\[1\], "):
        opgrad.evaluate(fn, [[1], [2, 3]])


# ----- the opgrad command: how a user error looks -----


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return code, out, err


def _last_line(err: str) -> str:
    return err.rstrip("\n").splitlines()[-1]


def _run_process(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "opgrad.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=300)


@pytest.mark.parametrize(("argv", "option", "expected", "given"), [
    (["train", "--lr", "inf"], "--lr", "a positive finite number", "'inf'"),
    (["train", "--lr", "nan"], "--lr", "a positive finite number", "'nan'"),
    (["train", "--lr", "0"], "--lr", "a positive finite number", "'0'"),
    (["train", "--lr", "-1"], "--lr", "a positive finite number", "'-1'"),
    (["train", "--lr", "fast"], "--lr", "a positive finite number", "'fast'"),
    (["train", "--epochs", "0"], "--epochs", "a positive integer", "'0'"),
    (["train", "--epochs", "2.5"], "--epochs", "a positive integer", "'2.5'"),
    (["train", "--batch-size", "0"], "--batch-size", "a positive integer", "'0'"),
    (["train", "--test-limit", "0"], "--test-limit", "a positive integer", "'0'"),
    (["train", "--test-limit", "-5"], "--test-limit", "a positive integer", "'-5'"),
    (["train", "--max-steps", "0"], "--max-steps", "a positive integer", "'0'"),
    (["train", "--augment-shift", "-1"], "--augment-shift", "an integer from 0 to 27", "'-1'"),
    (["train", "--augment-shift", "28"], "--augment-shift", "an integer from 0 to 27", "'28'"),
    (["train", "--seed", "-1"], "--seed", "a non-negative integer", "'-1'"),
    (["bench", "--steps", "0"], "--steps", "a positive integer", "'0'"),
    (["bench", "--warmup", "-1"], "--warmup", "a non-negative integer", "'-1'"),
    (["bench", "--batch-size", "0"], "--batch-size", "a positive integer", "'0'"),
    (["check", "relu", "--examples", "0"], "--examples", "a positive integer", "'0'"),
    (["check", "relu", "--examples", "1e3"], "--examples", "a positive integer", "'1e3'"),
    (["check", "relu", "--jobs", "0"], "--jobs", "a positive integer", "'0'"),
    (["check", "relu", "--seed", "-3"], "--seed", "a non-negative integer", "'-3'"),
])
def test_numeric_options_are_refused_by_argparse(argv: list[str], option: str, expected: str, given: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(argv, capsys)
    assert code == 2 and out == ""
    assert re.fullmatch(rf"opgrad {argv[0]}: error: argument {option}: expected {expected}.*, got {given}",
                        _last_line(err)), err


def test_a_bad_option_value_in_a_real_process_is_one_error_line_and_status_2() -> None:
    result = _run_process(["check", "relu", "--examples", "0"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert _last_line(result.stderr) == ("opgrad check: error: argument --examples: expected a positive integer "
                                         "(1, 2, ...), got '0'")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
def test_stop_on_nan_stops_with_epoch_step_loss_and_advice(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli([*SMOKE, "--lr", "1e30"], capsys)
    assert code == 1
    line = _last_line(err)
    assert re.fullmatch(r"opgrad train: error: training loss is (nan|inf|-inf) at epoch 1, step \d+ "
                        r"\(global step \d+\) with learning rate \S+: the run diverged; try a lower --lr "
                        r"\(this run's peak is 1e\+30\), or pass --no-stop-on-nan to keep training", line), line
    assert "done:" not in out
    code, out, err = _cli([*SMOKE, "--lr", "1e30", "--no-stop-on-nan"], capsys)
    assert code == 0 and "train loss nan" in out


def test_stop_on_nan_in_a_real_process_has_no_traceback() -> None:
    result = _run_process([*SMOKE, "--lr", "1e30"])
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert _last_line(result.stderr).startswith("opgrad train: error: training loss is ")
    assert "RuntimeWarning" not in result.stderr  # the error says it once, without numpy's overflow noise


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
def test_trainer_stop_on_nan_raises_a_dedicated_error_before_applying_the_step() -> None:
    rng = np.random.default_rng(0)
    images = rng.random((32, 1, 28, 28), dtype=np.float32)
    labels = rng.integers(0, 10, 32)
    trainer = nn.Trainer(nn.seed_cnn(), nn.SGD(), lr=1e30, batch_size=8)
    with pytest.raises(opgrad.NonFiniteLossError) as info:
        trainer.train_epoch(images, labels)
    exc = info.value
    assert isinstance(exc, opgrad.UserError) and exc.exit_code == 1
    assert exc.epoch == 1 and exc.epoch_step == exc.step and not np.isfinite(exc.loss) and exc.lr == 1e30
    assert trainer.step == exc.step - 1 and len(trainer.history.step_losses) == exc.step - 1
    assert f"at epoch 1, step {exc.step} (global step {exc.step}) with learning rate 1e+30" in str(exc)
    assert str(exc).endswith("the run diverged; try a lower learning rate")
    carry_on = nn.Trainer(nn.seed_cnn(), nn.SGD(), lr=1e30, batch_size=8, stop_on_nan=False)
    assert np.isnan(carry_on.train_epoch(images, labels))


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"lr": float("nan")}, "lr must be a finite number >= 0, got nan"),
    ({"lr": -1e-3}, "lr must be a finite number >= 0, got -0.001"),
    ({"lr": nn.cosine_lr(float("inf"), 10)}, "lr must be a finite number >= 0, got inf"),
    ({"lr": "fast"}, "lr must be a finite number >= 0 or a schedule (opgrad.nn.schedules), got 'fast'"),
    ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
    ({"eval_batch_size": 2.5}, "eval_batch_size must be a positive integer, got 2.5"),
    ({"augment_shift": -1}, "augment_shift must be an integer >= 0, got -1"),
    ({"backend": "gpu"}, "unknown backend 'gpu'; choose one of llvm, reference"),
])
def test_trainer_arguments_are_validated(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError) as info:
        nn.Trainer(nn.seed_cnn(), nn.SGD(), **kwargs)
    assert str(info.value) == f"Trainer: {words}"


@pytest.mark.parametrize("value", ["abc", "0", "-2", "2.5", "1_6", "+2", "\u0663"])  # int() takes the last three
def test_a_bad_thread_count_names_the_variable(value: str, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from opgrad.compiler.threads import default_num_threads

    monkeypatch.setenv("OPGRAD_NUM_THREADS", value)
    with pytest.raises(opgrad.ConfigError) as info:
        default_num_threads()
    assert isinstance(info.value, ValueError)
    assert str(info.value).startswith(f"environment variable OPGRAD_NUM_THREADS={value!r}: expected a positive "
                                      "integer")
    code, _, err = _cli(["ops"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"opgrad ops: error: environment variable OPGRAD_NUM_THREADS={value!r}: expected a "
                          "positive integer")


def test_a_bad_conv_algorithm_is_one_line_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("OPGRAD_CONV_ALGORITHM", "fft")
    code, _, err = _cli(["ops"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("opgrad ops: error: environment variable OPGRAD_CONV_ALGORITHM='fft': expected one of "
                          "auto, direct, winograd")


def test_a_thread_count_set_after_the_pool_started_is_warned_about_once(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        import os, warnings
        import opgrad
        from opgrad import ops
        x = opgrad.var("x", (4,), "float32")
        opgrad.compile(opgrad.function([x], ops.relu(x)))
        os.environ["OPGRAD_NUM_THREADS"] = "7"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opgrad.compile(opgrad.function([x], ops.tanh(x)))
            opgrad.compile(opgrad.function([x], ops.exp(x)))
        from opgrad.compiler.threads import pool_size
        print(pool_size(), [str(w.message) for w in caught])
    """)
    env = {**os.environ, "OPGRAD_NUM_THREADS": "2", "OPGRAD_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("2 [\"OPGRAD_NUM_THREADS='7' takes no effect in this process: it is read when the "
                                     "first kernel is compiled, and the worker pool keeps its 2 thread(s); set it "
                                     "before that (or start a new process)\"]")


def test_a_good_or_empty_thread_count_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    from opgrad.compiler.threads import default_num_threads

    monkeypatch.setenv("OPGRAD_NUM_THREADS", "3")
    assert default_num_threads() == 3
    monkeypatch.setenv("OPGRAD_NUM_THREADS", "")
    assert default_num_threads() >= 1


def test_thousands_of_threads_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from opgrad.compiler.threads import default_num_threads

    monkeypatch.setenv("OPGRAD_NUM_THREADS", "4096")
    with pytest.raises(ValueError, match=r"OPGRAD_NUM_THREADS='4096': at most 256 worker threads"):
        default_num_threads()
    monkeypatch.setenv("OPGRAD_NUM_THREADS", "256")
    assert default_num_threads() == 256


def test_a_bad_thread_count_in_a_real_process_is_one_line() -> None:
    result = _run_process(["train", "--epochs", "1"], env={"OPGRAD_NUM_THREADS": "abc"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "OPGRAD_NUM_THREADS='abc'" in result.stderr


def test_a_directory_named_like_an_idx_file_is_reported_as_a_directory(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train-images-idx3-ubyte").mkdir()
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: is a directory, expected the MNIST IDX file"):
        load_mnist_dir(tmp_path)
    code, _, err = _cli([*SMOKE, "--data", str(tmp_path)], capsys)
    assert code == 2
    assert _last_line(err).startswith(f"opgrad train: error: {tmp_path / 'train-images-idx3-ubyte'}: is a directory")


def test_output_paths_are_checked_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such"
    for option, name in (("--save", "run.npz"), ("--plot", "curves.png")):
        code, out, err = _cli([*SMOKE, option, str(missing / name)], capsys)
        assert code == 2 and "epoch" not in out
        assert err == f"opgrad train: error: {option} {missing / name}: directory {missing} does not exist\n"
        code, out, err = _cli([*SMOKE, option, str(tmp_path)], capsys)
        assert code == 2 and err == f"opgrad train: error: {option} {tmp_path}: is a directory, expected a file path\n"


def test_a_plot_that_would_overwrite_the_checkpoint_is_refused(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = str(tmp_path / "run.npz")
    code, out, err = _cli([*SMOKE, "--save", path, "--plot", path], capsys)
    assert code == 2 and "epoch" not in out
    assert err == (f"opgrad train: error: --plot {path}: is also the --save file, which writing it would destroy; "
                   "give the output its own path\n")


def test_an_output_over_one_of_the_commands_inputs_is_refused(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = tmp_path / "run.npz"
    assert cli.main([*SMOKE, "--save", str(checkpoint)]) == 0
    images = tmp_path / "images.npy"
    np.save(images, np.zeros((2, 1, 28, 28), np.float32))
    before = checkpoint.read_bytes(), images.read_bytes()
    for argv, option, other in (
            (["predict", "--checkpoint", str(checkpoint), "--images", str(images), "--output", str(checkpoint)],
             "--output", "--checkpoint"),
            (["predict", "--checkpoint", str(checkpoint), "--images", str(images), "--output", str(images)],
             "--output", "--images"),
            (["export-onnx", str(checkpoint), str(checkpoint)], "OUT", "CKPT"),
            (["import", str(checkpoint), "--save", str(checkpoint)], "--save", "MODEL")):
        code, _, err = _cli(argv, capsys)
        written = checkpoint if other != "--images" else images
        assert code == 2 and err.endswith(f"error: {option} {written}: is also the {other} file, which writing it "
                                          "would destroy; give the output its own path\n"), err
    assert (checkpoint.read_bytes(), images.read_bytes()) == before


def test_an_output_directory_that_cannot_be_written_is_refused_before_training(
        capsys: pytest.CaptureFixture[str]) -> None:
    # Root may write anywhere by permission bits; /proc still refuses new files.
    code, out, err = _cli([*SMOKE, "--save", "/proc/run.npz"], capsys)
    assert code == 2 and "epoch" not in out
    assert err.startswith("opgrad train: error: --save /proc/run.npz: cannot write in directory /proc: "), err


def test_resume_errors_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.npz"
    code, _, err = _cli([*SMOKE, "--resume", str(missing)], capsys)
    assert code == 2 and _last_line(err) == f"opgrad train: error: {missing}: checkpoint file not found"
    code, _, err = _cli([*SMOKE, "--resume", str(tmp_path)], capsys)
    assert code == 2
    assert _last_line(err) == f"opgrad train: error: {tmp_path}: is a directory, expected a checkpoint file"
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    code, _, err = _cli([*SMOKE, "--resume", str(garbage)], capsys)
    assert code == 2 and _last_line(err).startswith(f"opgrad train: error: {garbage}: not an .npz checkpoint")


def test_a_failed_save_during_training_is_one_line_naming_the_checkpoint(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", disk_full)
    target = tmp_path / "run.npz"
    code, out, err = _cli([*SMOKE, "--save", str(target)], capsys)
    assert code == 1 and "epoch 1/1: train loss" in out
    assert _last_line(err) == f"opgrad train: error: {target}: cannot write the checkpoint: No space left on device"
    assert os.listdir(tmp_path) == []


def test_an_unknown_op_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _cli(["check", "no_such_op"], capsys)
    assert code == 2 and err == "opgrad check: error: no operator named 'no_such_op' is registered\n"


def test_internal_bugs_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: object) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr("opgrad.optable.run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["ops"])


# ----- checkpoint temporaries -----


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


ARRAYS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}


def test_temporaries_are_named_after_the_target_and_the_writer(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with atomic_writer(target) as handle:
        handle.write(b"data")
        (name,) = os.listdir(tmp_path)
    assert re.fullmatch(rf"\.out\.bin\.tmp-{os.getpid()}-[0-9a-f]{{12}}", name)
    assert os.listdir(tmp_path) == ["out.bin"]


def test_a_save_removes_stale_temporaries_of_its_target_only(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.npz"
    stale = [tmp_path / f".ckpt.npz.tmp-{_dead_pid()}-0123456789ab",  # a job killed mid-save
             tmp_path / f".ckpt.npz.tmp-{os.getpid()}-ba9876543210"]  # this pid, but not being written
    live = tmp_path / f".ckpt.npz.tmp-{os.getppid()}-00000000000f"  # a writer that still runs
    other = tmp_path / f".other.npz.tmp-{_dead_pid()}-0123456789ab"  # another target's
    unrelated = tmp_path / "ckpt.npz.tmp-notes"
    for path in [*stale, live, other, unrelated]:
        path.write_bytes(b"partial")
    save_checkpoint(target, ARRAYS, {"epoch": 1})
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in [target, live, other, unrelated])
    assert load_checkpoint(target).meta == {"epoch": 1}


def test_a_second_writer_in_the_same_process_keeps_the_first_ones_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with atomic_writer(target) as first:
        first.write(b"first")
        with atomic_writer(target) as second:
            second.write(b"second")
    assert target.read_bytes() == b"first" and os.listdir(tmp_path) == ["out.bin"]


def test_loading_refuses_a_temporary_and_ignores_those_beside_the_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "ckpt.npz"
    save_checkpoint(target, ARRAYS, {"epoch": 2})
    temp = tmp_path / f".ckpt.npz.tmp-{os.getppid()}-0123456789ab"
    temp.write_bytes(b"PK\x03\x04 half written")
    np.testing.assert_array_equal(load_checkpoint(target).arrays["w"], ARRAYS["w"])
    with pytest.raises(CheckpointError, match=rf"is an unfinished temporary file of {re.escape(str(target))}, "
                                              "left by a save that did not complete; load .* instead"):
        load_checkpoint(temp)


def test_an_unwritable_destination_names_the_target_not_the_temporary(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "ckpt.npz"
    with pytest.raises(opgrad.OutputFileError) as info:
        save_checkpoint(target, ARRAYS, {})
    assert str(info.value) == f"{target}: cannot write the checkpoint: directory {target.parent} does not exist"
    assert isinstance(info.value, OSError)
    with pytest.raises(OSError, match="is a directory"):
        save_checkpoint(tmp_path, ARRAYS, {})


@pytest.mark.parametrize("backend", ["llvm", "reference"])
def test_native_multi_step_loop_stops_on_nan_like_single_steps(backend: str) -> None:
    """--steps-per-call K stops at the same step, with the same parameters, as K single steps,
    and neither way lets numpy's overflow warnings out (the error reports the divergence)."""
    import warnings

    rng = np.random.default_rng(0)
    images = rng.random((48, 1, 28, 28), dtype=np.float32)
    labels = rng.integers(0, 10, 48)
    single = nn.Trainer(nn.seed_cnn(), nn.SGD(), lr=1e30, batch_size=8, backend=backend)
    looped = nn.Trainer(nn.seed_cnn(), nn.SGD(), lr=1e30, batch_size=8, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(opgrad.NonFiniteLossError) as one:
            single.train_epoch(images, labels)
        with pytest.raises(opgrad.NonFiniteLossError) as many:
            looped.train_epoch(images, labels, steps_per_call=4)
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert (many.value.step, many.value.epoch_step) == (one.value.step, one.value.epoch_step)
    assert looped.step == single.step == one.value.step - 1
    for name, value in single.params.items():
        np.testing.assert_array_equal(looped.params[name], value)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_ndarray_subclasses_are_their_arrays_and_masked_arrays_are_refused() -> None:
    """np.matrix's * is a matrix product: the reference's numpy forwards see the plain array, as
    the compiled kernels do. A masked array's mask would be ignored by every kernel: refused."""
    x, y = opgrad.var("x", (2, 2)), opgrad.var("y", (2, 2))
    fn = opgrad.function([x, y], ops.multiply(x, y))
    a = np.matrix([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    b = np.matrix([[5.0, 6.0], [7.0, 8.0]], dtype=np.float32)
    for run in (lambda *v: opgrad.evaluate(fn, *v), opgrad.compile(fn)):
        got = run(a, b)
        assert type(got) is np.ndarray
        np.testing.assert_array_equal(got, [[5.0, 12.0], [21.0, 32.0]])
        masked = np.ma.masked_array(np.asarray(a), mask=[[1, 0], [0, 0]])
        with pytest.raises(opgrad.ArgumentError, match="argument 'x' is a masked array"):
            run(masked, b)


def test_wrt_is_checked_and_new_parameters_never_clash() -> None:
    x, y = opgrad.var("x", (3,)), opgrad.var("y", (3,))
    f = opgrad.function([x, y], ops.sum(x * y * y))
    with pytest.raises(ValueError, match=r"wrt position 5 is out of range: the function has 2 parameter"):
        opgrad.grad(f, wrt=5)
    with pytest.raises(TypeError, match="wrt entries are parameter positions"):
        opgrad.grad(f, wrt=True)
    assert opgrad.grad(f, wrt=[np.int64(1)]).outputs[1].shape == (3,)  # a numpy integer is a position
    for derivative in (opgrad.hvp, opgrad.jvp):
        with pytest.raises(ValueError, match=rf"opgrad.{derivative.__name__}: wrt selects no parameter"):
            derivative(f, wrt=[])
    # hvp's and jvp's new parameters are named v_<name> / t_<name>, unless the function has those.
    w, v_w, t_w = (opgrad.var(name, (3,), "float64") for name in ("w", "v_w", "t_w"))
    h = opgrad.hvp(opgrad.function([w, v_w], ops.sum(ops.square(w) * v_w)), wrt=["w"])
    assert [p.name for p in h.params] == ["w", "v_w", "_v_w"]
    np.testing.assert_allclose(opgrad.evaluate(h, np.ones(3), np.full(3, 2.0), np.full(3, 3.0)), np.full(3, 12.0))
    j = opgrad.jvp(opgrad.function([w, t_w], ops.sum(ops.square(w) * t_w)), wrt=["w"])
    assert [p.name for p in j.params] == ["w", "t_w", "_t_w"]



def test_a_bad_option_value_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's usage block would bury the error: every command's usage error is one line."""
    from opgrad import cli

    for argv in (["train", "--epochs", "0"], ["bench", "--model", "vgg"], ["check", "--examples", "x"], ["nosuch"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("opgrad") and ": error: " in err and err.count("\n") == 1, err


CLOSED_PIPE = """
import os, sys
from opgrad import cli
read, write = os.pipe()
os.close(read)  # the reader is gone, as when `opgrad ops | head -1` has its line
os.dup2(write, sys.stdout.fileno())
code = cli.main(["ops"])
print(f"exit {code}", file=sys.stderr)
"""


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    done = subprocess.run([sys.executable, "-c", CLOSED_PIPE], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert "exit 0" in done.stderr and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
