"""Every user mistake is refused in one line before anything is written (issue 15).

A table of mistakes a new user makes with `--gin_file=gin/single.gin` plus one wrong thing:
gin that does not parse, every `train.*` parameter of the wrong type or out of range, the
other configurables' parameters, broken step, eval and model functions. Each must exit 2 with
exactly one `error:` line naming the problem, no traceback, and leave `model_dir` byte for byte
as it was. They run through `trainer.main`'s own flag parsing and `run` in one fresh
interpreter (one TensorFlow start for the whole table), a few also as real processes.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support import REPO, main_in_one_process, refused_run, run_main, tree_digest

# The module-scoped fixture below is shared by this file's tests: one worker runs them all.
pytestmark = pytest.mark.xdist_group("mistakes")

GIN = "--gin_file=gin/single.gin"
IMPORT = "--gin_bindings=import tests.broken_functions"
UNCLOSED = "include 'gin/single.gin'\ntrain.total_steps = (3\n"
MISSING_INCLUDE = "include 'gin/nothere.gin'\n"
SYNTAX = "include 'gin/single.gin'\ntrain.total_steps = = 3\n"


def bind(*bindings: str) -> list[str]:
    return [GIN, *(f"--gin_bindings={b}" for b in bindings)]


# name -> (command-line arguments, a piece of the expected error line)
CASES: dict[str, tuple[list[str], str]] = {
    # gin that does not parse
    "gin_unclosed_parenthesis": (["--gin_file={dir}/unclosed.gin"], "unclosed.gin:3"),
    "gin_missing_include": (["--gin_file={dir}/include.gin"], "include.gin:1"),
    "gin_syntax_error": (["--gin_file={dir}/syntax.gin"], "syntax.gin:2"),
    "gin_unknown_configurable": (bind("trainr.total_steps = 3"), "trainr"),
    "gin_unknown_parameter": (bind("train.total_step = 3"), "total_step"),
    "gin_unclosed_binding": (bind("train.total_steps = (3"), "--gin_bindings"),
    "gin_file_missing": (["--gin_file=gin/nothere.gin"], "gin/nothere.gin not found"),
    "gin_import_missing_module": (bind("import no_such_module"), "no_such_module"),
    "unknown_flag": ([GIN, "--no_such_flag=1"], "no_such_flag"),
    # make_optimizer
    "optimizer_learning_rate_text": (bind("make_optimizer.learning_rate = 'fast'"), "make_optimizer.learning_rate"),
    "optimizer_learning_rate_negative": (bind("make_optimizer.learning_rate = -0.1"), "make_optimizer.learning_rate"),
    "optimizer_momentum_text": (bind("make_optimizer.momentum = 'lots'"), "make_optimizer.momentum"),
    "optimizer_momentum_above_one": (bind("make_optimizer.momentum = 1.5"), "make_optimizer.momentum"),
    "optimizer_name": (bind("make_optimizer.name = 'adamm'"), "unknown optimizer 'adamm'"),
    "optimizer_warmup_negative": (bind("make_optimizer.warmup_steps = -5"), "make_optimizer.warmup_steps"),
    "optimizer_decay": (bind("make_optimizer.decay = 'linear'"), "unknown decay"),
    "optimizer_reference_batch_zero": (
        bind("make_optimizer.reference_batch_size = 0"),
        "make_optimizer.reference_batch_size",
    ),
    # train: integers of the wrong type and out of range
    **{
        f"train_{name}_{kind}": (bind(f"train.{name} = {value}"), f"train.{name}")
        for name in (
            "total_steps",
            "global_batch_size",
            "steps_per_loop",
            "log_every_steps",
            "checkpoint_every_steps",
            "eval_every_steps",
            "keep_checkpoints",
        )
        for kind, value in (("text", "'many'"), ("zero_or_negative", "-1"))
    },
    "train_global_batch_size_float": (bind("train.global_batch_size = 1.5"), "train.global_batch_size"),
    "train_seed_negative": (bind("train.seed = -1"), "train.seed"),
    "train_max_rollbacks_text": (bind("train.max_rollbacks = 'x'"), "train.max_rollbacks"),
    "train_max_rollbacks_above_capacity": (bind("train.max_rollbacks = 65"), "train.max_rollbacks"),
    # train: choices and booleans
    "train_nonfinite": (bind("train.nonfinite = 'ignore'"), "train.nonfinite"),
    "train_strategy": (bind("train.strategy = 'mirror'"), "train.strategy"),
    "train_strategy_number": (bind("train.strategy = 3"), "train.strategy"),
    "train_distribute_method": (bind("train.distribute_method = 'datasets'"), "train.distribute_method"),
    "train_shard_policy": (bind("train.shard_policy = 'SOME'"), "train.shard_policy"),
    "train_cluster_resolver": (bind("train.cluster_resolver = 'k8s'"), "train.cluster_resolver"),
    "train_mixed_precision": (bind("train.mixed_precision = 'fp16'"), "train.mixed_precision"),
    "train_mixed_precision_number": (bind("train.mixed_precision = 16"), "train.mixed_precision"),
    "train_collective_timeout_negative": (
        bind("train.collective_timeout_secs = -1.0"),
        "train.collective_timeout_secs",
    ),
    "train_check_loss_scaling_text": (bind("train.check_loss_scaling = 'yes'"), "train.check_loss_scaling"),
    "train_jit_compile_text": (bind("train.jit_compile = 'yes'"), "train.jit_compile"),
    "train_allow_resume_changes_number": (bind("train.allow_resume_changes = 1"), "train.allow_resume_changes"),
    "train_preemption_text": (bind("train.preemption_checkpointing = 'no'"), "train.preemption_checkpointing"),
    # options of a built-in extension, checked where its table entry makes it (trainer/extensions/built_in.py)
    "train_keep_best_text": (bind("train.keep_best = 'two'"), "train.keep_best"),
    "train_export_saved_model_text": (bind("train.export_saved_model = 'yes'"), "train.export_saved_model"),
    "train_early_stopping_number": (bind("train.early_stopping = 3"), "train.early_stopping must be @early_stopping()"),
    # train: what must be functions, hooks, settings objects
    "train_step_fn_number": (bind("train.step_fn = 3"), "train.step_fn"),
    "train_eval_step_fn_text": (bind("train.eval_step_fn = 'x'"), "train.eval_step_fn"),
    "train_model_fn_number": (bind("train.model_fn = 5"), "train.model_fn"),
    "train_model_fn_called": (bind("train.model_fn = @cnn()"), "write @cnn without parentheses"),
    "train_optimizer_fn_text": (bind("train.optimizer_fn = 'adam'"), "train.optimizer_fn"),
    "train_eval_metrics_fn_number": (bind("train.eval_metrics_fn = 3"), "train.eval_metrics_fn"),
    "train_input_fn_text": (bind("train.input_fn = 'digits'"), "train.input_fn"),
    "train_input_and_data_source": (
        bind("train.input_fn = @digits()", "train.data_source = @synthetic()"),
        "both train.input_fn and train.data_source",
    ),
    "train_hooks_retired": (
        bind("train.hooks = [@profiler_hook()]"),
        "train.hooks is gone: hooks and extensions are one type now; bind train.extensions = [@my_extension()]",
    ),
    "train_parameter_server_text": (bind("train.parameter_server = 'x'"), "train.parameter_server"),
    "train_device_config_text": (bind("train.device_config = 'gpu'"), "train.device_config"),
    "train_cluster_resolver_options_text": (
        bind("train.cluster_resolver_options = 'x'"),
        "train.cluster_resolver_options",
    ),
    "train_eval_splits_text": (bind("train.eval_splits = 'eval'"), "train.eval_splits"),
    "train_eval_splits_unknown": (bind("train.eval_splits = ['test']"), "test"),
    "train_eval_splits_twice": (
        bind("train.eval_splits = ['eval', 'test', 'eval', 'test', 'x']"),
        "train.eval_splits names 'eval', 'test' more than once",
    ),
    # other configurables
    "devices_logical_cpus_negative": (bind("devices.logical_cpus = -1"), "devices.logical_cpus"),
    "devices_visible_gpus_text": (bind("devices.visible_gpus = 'all'"), "devices.visible_gpus"),
    "digits_eval_fraction": (bind("train.input_fn = @digits()", "digits.eval_fraction = 1.5"), "digits.eval_fraction"),
    "synthetic_num_train_negative": (
        bind("train.input_fn = @synthetic()", "synthetic.num_train = -3"),
        "synthetic.num_train",
    ),
    "fashion_mnist_missing_files": (
        bind("train.input_fn = @fashion_mnist()", "fashion_mnist.data_dir = '/nonexistent/fashion'"),
        "Fashion-MNIST file",
    ),
    "fashion_mnist_standardize_old_switch": (
        bind("train.input_fn = @fashion_mnist()", "fashion_mnist.standardize = True"),
        "'per_pixel' (each pixel its own, what True did)",
    ),
    "fashion_mnist_validation_size_alone": (
        bind("train.input_fn = @fashion_mnist()", "fashion_mnist.validation_size = 5000"),
        "fashion_mnist.validation_from",
    ),
    "fashion_mnist_validation_from_unknown": (
        bind(
            "train.input_fn = @fashion_mnist()",
            "fashion_mnist.validation_size = 9",
            "fashion_mnist.validation_from = 'start'",
        ),
        "unknown fashion_mnist.validation_from 'start'",
    ),
    "progress_logger_refresh_text": (bind("progress_logger.refresh_secs = 'often'"), "progress_logger.refresh_secs"),
    "profiler_hook_steps_reversed": (
        bind("train.extensions = [@profiler_hook()]", "profiler_hook.steps = (20, 10)"),
        "profiler_hook.steps",
    ),
    "cnn_dropout_above_one": (bind("cnn.dropout = 1.5"), "cnn.dropout"),
    "cnn_filters_text": (bind("cnn.filters = 'abc'"), "cnn.filters"),
    "cnn_dense_units_zero": (bind("cnn.dense_units = 0"), "cnn.dense_units"),
    "cnn_pool_padding_unknown": (bind("cnn.pool_padding = 'full'"), "unknown cnn.pool_padding 'full'"),
    "cnn_valid_pooling_too_small": (
        bind("cnn.pool_padding = 'valid'", "cnn.filters = (8, 8, 8, 8)"),
        "pools the 8x8 images to nothing in 4 blocks",
    ),
    # the user's own functions
    "step_returns_list": ([IMPORT, *bind("train.step_fn = @list_step")], "returned list"),
    "step_returns_vector": ([IMPORT, *bind("train.step_fn = @vector_step")], "scalar"),
    "step_returns_string": ([IMPORT, *bind("train.step_fn = @string_step")], "scalar"),
    "eval_step_without_num_examples": (
        [IMPORT, *bind("train.eval_step_fn = @no_count_eval_step")],
        "no 'num_examples'",
    ),
    "eval_step_returns_list": ([IMPORT, *bind("train.eval_step_fn = @list_eval_step")], "returned list"),
    "model_fn_parameter_unsuppliable": (
        [IMPORT, *bind("train.model_fn = @model_with_unknown_parameter")],
        "'vocabulary'",
    ),
    "model_fn_returns_no_model": ([IMPORT, *bind("train.model_fn = @not_a_model")], "not a Keras model"),
    "model_cannot_take_the_batch": (
        [IMPORT, *bind("train.model_fn = @model_of_wrong_input")],
        "cannot run on the batches",
    ),
    "optimizers_keyed_unlike_models": (
        [IMPORT, *bind("train.optimizer_fn = @two_optimizers")],
        "key each optimizer like the model",
    ),
    "input_fn_batched": ([IMPORT, *bind("train.input_fn = @batched_input")], "batched_input"),
    "rollback_with_nondeterministic_input": (
        [IMPORT, *bind("train.input_fn = @random_input", "train.nonfinite = 'rollback'")],
        "deterministic = False",
    ),
    "input_fn_not_a_dataset": ([IMPORT, *bind("train.input_fn = @list_input")], "list_input"),
    # what every bound function returns, checked for kind and structure
    "optimizer_fn_returns_none": (
        [IMPORT, *bind("train.optimizer_fn = @none_optimizer")],
        "none_optimizer returned NoneType, not an optimizer",
    ),
    "model_fn_returns_none": ([IMPORT, *bind("train.model_fn = @none_model")], "none_model returned NoneType"),
    "step_returns_none": ([IMPORT, *bind("train.step_fn = @none_step")], "returned NoneType"),
    "eval_metrics_fn_returns_list": (
        [IMPORT, *bind("train.eval_metrics_fn = @list_metrics")],
        "list_metrics returned list; return a dict of names to Keras metrics",
    ),
    "eval_metrics_fn_returns_numbers": (
        [IMPORT, *bind("train.eval_metrics_fn = @number_metrics")],
        "number_metrics returned {'auc': int}",
    ),
    "extensions_not_extensions": (bind("train.extensions = ['swa']"), "train.extensions must be a list of extensions"),
    "keras_callbacks_not_callbacks": (
        bind("train.keras_callbacks = [3]"),
        "train.keras_callbacks must be a list of keras.callbacks.Callback",
    ),
    # models that build on their first call, and those that cannot
    "model_without_weights": (
        ["--gin_bindings=import tests.unbuilt_models", *bind("train.model_fn = @weightless")],
        "has no trainable variables even after a call on a batch of the train features",
    ),
    "model_not_buildable_from_the_features": (
        ["--gin_bindings=import tests.unbuilt_models", *bind("train.model_fn = @noise_generator")],
        "is not built, and calling it on a batch of the train features",
    ),
    # extensions refused once the traced outputs are known, before the first write
    "best_metric_not_an_output": (
        bind("train.keep_best = 2", "train.best_metric = 'top5'"),
        "train.best_metric 'top5' is not an output of eval split 'eval'",
    ),
    "early_stopping_metric_not_an_output": (
        bind("train.early_stopping = @early_stopping()", "early_stopping.metric = 'auc'"),
        "early_stopping.metric 'auc' is not an output",
    ),
    "ema_decay_out_of_range": (bind("train.ema_decay = 2.0"), "train.ema_decay must be a number > 0 and < 1"),
    # the user's own code raising: one line naming it and its binding, its own frames above
    "input_fn_raises": (
        [IMPORT, *bind("train.input_fn = @missing_file_input")],
        "train.input_fn = @missing_file_input raised FileNotFoundError",
    ),
    "input_fn_without_split": ([IMPORT, *bind("train.input_fn = @input_without_split")], "takes no split"),
    "eval_split_missing_from_the_users_dict": (
        [IMPORT, *bind("train.input_fn = @dict_input", "train.eval_splits = ['test']")],
        "train.input_fn = @dict_input raised KeyError: 'test' for split 'test'",
    ),
    "keras_callback_raises": (
        [IMPORT, *bind("train.keras_callbacks = [@raising_callback()]")],
        "RaisingCallback.on_train_begin (train.keras_callbacks) raised KeyError",
    ),
    "extension_method_typo": (
        [IMPORT, *bind("train.extensions = [@misspelt_extension()]")],
        "MisspeltExtension.atach is not a method of the extension protocol, and the "
        "run never calls it; did you mean attach?",
    ),
    "model_fn_raises": (
        [IMPORT, *bind("train.model_fn = @raising_model")],
        "train.model_fn = @raising_model raised IndexError: list index out of range",
    ),
    # the model's own call has a bug: named by its method, the user's frames only
    "model_call_raises": (
        [IMPORT, *bind("train.model_fn = @model_whose_call_raises")],
        "_CallRaises.call, called on a batch of the train features [None, 8, 8, 1] to build the "
        "model of train.model_fn model_whose_call_raises, raised AttributeError: "
        "'_CallRaises' object has no attribute 'missing_index'",
    ),
    # a layer of the user's raising in the traced train step: the cause and the call, not Keras' wrapper line
    "layer_call_raises_in_training": (
        [IMPORT, *bind("train.model_fn = @model_whose_layer_fails_in_training")],
        "(ValueError in _WrongSideInput.call(): Input 0 with name 'None' of layer 'side' is incompatible with the "
        "layer: expected axis -1 of input shape to have value 7, but received input with shape (64, 64))",
    ),
    # an endless dataset (unknown cardinality): counted for a bounded time, then refused
    "input_fn_endless_generator": ([IMPORT, *bind("train.input_fn = @endless_generator_input")], "an endless dataset?"),
    # the data an op cannot take, found by the first step: the input and the op named
    "labels_are_strings": (
        [IMPORT, *bind("train.input_fn = @string_label_input", "cnn.num_classes = 4")],
        "op Cast failed on a batch after step 0 (UnimplementedError: Cast string to int32",
    ),
    "labels_one_based": (
        # other data than the run at step 20 was trained on: allowed, so the labels are what fails
        [IMPORT, *bind("train.input_fn = @one_based_label_input", "train.allow_resume_changes = True")],
        "op SparseSoftmaxCrossEntropyWithLogits failed on a batch after step 20 "
        "(InvalidArgumentError: Received a label value of 10",
    ),
    # examples the built-in steps would misread, and a model too narrow for the labels
    "third_element_an_example_id": (
        [IMPORT, *bind("train.input_fn = @id_input")],
        "train.input_fn = @id_input yields a third element of int64 (), which the built-in steps (train.step_fn = "
        "@classification_step and train.eval_step_fn = @classification_eval_step) take as the sample weight: one "
        "float per example; an example id or other data goes into the features",
    ),
    "dict_examples_without_a_label": (
        [IMPORT, *bind("train.input_fn = @unlabelled_dict_input")],
        "train.input_fn = @unlabelled_dict_input yields dict examples (keys image, label); the built-in steps",
    ),
    "model_narrower_than_the_classes": (
        [IMPORT, *bind("train.model_fn = @narrow_model")],
        "the model (train.model_fn = @narrow_model) outputs 5 logits but the default input (the embedded digits: "
        "train.input_fn is unset) has 10 classes",
    ),
}
# Cases run in an empty model_dir (holding only a user's file) rather than a copy of an existing
# run's, where the resume check (a changed model) would speak first, also in one line.
FRESH_ONLY = {
    "model_cannot_take_the_batch",
    "labels_are_strings",
    "layer_call_raises_in_training",
    "model_narrower_than_the_classes",
}

# The endless dataset's count is refused after a shorter bound than the real 20 s, with progress lines
# on the way: the same path (tests/test_inputs.py checks the bound and the line themselves).
SHORT_COUNT = "from trainer.data import inputs\ninputs.COUNT_SECONDS, inputs.COUNT_PROGRESS_SECONDS = 4.0, 1.0"


def test_the_table_has_at_least_40_mistakes():
    assert len(CASES) >= 40


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict:
    """Every case against a copy of an existing run's model_dir (with a user's file in it): a refusal
    must leave a run's checkpoints, records and metrics byte for byte as they were."""
    root = tmp_path_factory.mktemp("mistakes")
    for name, text in (("unclosed", UNCLOSED), ("include", MISSING_INCLUDE), ("syntax", SYNTAX)):
        (root / f"{name}.gin").write_text(text)
    existing = root / "existing"
    proc = run_main(
        GIN,
        f"--model_dir={existing}",
        "--gin_bindings=train.total_steps=20",
        "--gin_bindings=train.checkpoint_every_steps=10",
        "--gin_bindings=train.eval_every_steps=10",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = {}
    for name, (args, _) in CASES.items():
        model_dir = root / name
        if name in FRESH_ONLY:
            model_dir.mkdir()
        else:
            shutil.copytree(existing, model_dir)
        (model_dir / "notes.txt").write_text("a file the user keeps in model_dir\n")
        cases[name] = ([a.replace("{dir}", str(root)) for a in args], str(model_dir))
    return main_in_one_process(cases, prelude=SHORT_COUNT)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first case's covers the fixture: every case in one process, 80 s on 2 idle cores
@pytest.mark.parametrize("name", sorted(CASES))
def test_mistake_is_one_line_exit_2_and_model_dir_unchanged(outcomes, name):
    outcome, expected = outcomes[name], CASES[name][1]
    assert "Traceback" not in outcome["stderr"] + outcome["stdout"], outcome["stderr"][-3000:]
    assert outcome["code"] == 2, outcome["stderr"][-3000:]
    lines = [line for line in outcome["stderr"].splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], lines
    assert expected in errors[0], errors[0]
    assert outcome["unchanged"]
    assert outcome["seconds"] < 60


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "input_fn_raises",
        "eval_split_missing_from_the_users_dict",
        "keras_callback_raises",
        "model_fn_raises",
        "model_call_raises",
        "layer_call_raises_in_training",
    ],
)
def test_what_user_code_raises_shows_only_its_frames(outcomes, name):
    stderr = outcomes[name]["stderr"]
    frames = [line for line in stderr.splitlines() if line.lstrip().startswith("File ")]
    assert frames and all("tests/broken_functions.py" in line for line in frames), stderr


@pytest.mark.slow
def test_an_endless_dataset_says_how_far_its_count_got(outcomes):
    stdout = outcomes["input_fn_endless_generator"]["stdout"]
    assert "counting split 'train' (its size is unknown to tf.data):" in stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gin_unclosed_parenthesis", "optimizer_momentum_text", "step_returns_list"])
def test_the_same_mistakes_from_a_real_process(tmp_path, name):
    for text_name, text in (("unclosed", UNCLOSED),):
        (tmp_path / f"{text_name}.gin").write_text(text)
    model_dir = tmp_path / "run"
    model_dir.mkdir()
    (model_dir / "notes.txt").write_text("keep\n")
    before = tree_digest(str(model_dir))
    args = [a.replace("{dir}", str(tmp_path)) for a in CASES[name][0]]
    proc = run_main(*args, f"--model_dir={model_dir}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0]
    assert CASES[name][1] in errors[0]
    assert tree_digest(str(model_dir)) == before and os.path.isdir(REPO)


@pytest.mark.slow
def test_a_run_that_dies_of_its_data_at_the_first_step_leaves_no_model_dir(tmp_path):
    model_dir = tmp_path / "new"
    proc = run_main(*CASES["labels_one_based"][0], f"--model_dir={model_dir}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith("error: op SparseSoftmaxCrossEntropyWithLogits failed on a batch after step 0")
    )
    assert not model_dir.exists()


@pytest.mark.slow
@pytest.mark.parametrize("gin_file", ["gin/mirrored.gin", "gin/mwms.gin"])
def test_a_model_built_at_import_is_named(tmp_path, gin_file):
    line = refused_run(
        tmp_path,
        f"--gin_file={gin_file}",
        "--gin_bindings=import tests.import_time_model",
        "--gin_bindings=train.model_fn = @import_time_model",
    )
    assert line.startswith(
        "error: tests.import_time_model.MODEL was built when its module was imported, outside the strategy's scope"
    ), line
    assert line.endswith("build models inside train.model_fn, which the run calls under the strategy's scope"), line


@pytest.mark.slow
def test_a_layer_raising_in_a_mirrored_train_step_is_named_with_its_cause(tmp_path):
    line = refused_run(
        tmp_path,
        "--gin_file=gin/mirrored.gin",
        IMPORT,
        "--gin_bindings=train.model_fn = @model_whose_layer_fails_in_training",
        "--gin_bindings=model_whose_layer_fails_in_training.layer = 'no_training'",
    )
    assert "(ValueError in _NoTraining.call(): _NoTraining has no training branch); fix" in line, line


@pytest.mark.parametrize(
    "name, suggestion",
    [
        ("atach", "attach"),
        ("after_lop", "after_loop"),
        ("verfy", "verify"),
        ("state_dic", "state_dict"),
        ("begn", "begin"),
        ("send", None),
        ("log_weights", None),
        ("ende", None),
    ],
)
def test_a_near_miss_of_a_protocol_method_is_refused_with_the_suggestion(name, suggestion):
    from trainer.errors import UserError
    from trainer.extensions.protocol import Extension, check_method_names

    extension = type("Mine", (Extension,), {name: lambda self: None})()
    if suggestion is None:
        check_method_names([extension])  # a helper of its own, no typo
        return
    with pytest.raises(UserError, match=rf"^Mine\.{name} is not a method .*; did you mean {suggestion}\?"):
        check_method_names([extension])


def test_a_model_dir_that_cannot_hold_a_run_is_refused_and_none_is_made(tmp_path):
    from trainer.errors import UserError
    from trainer.files.model_dir import check_model_dir

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    for model_dir, message in (
        ("", "model_dir is empty; pass --model_dir=DIR"),
        (str(a_file), f"model_dir {a_file} exists and is not a directory; pick another --model_dir"),
        (str(a_file / "run"), f"model_dir {a_file / 'run'} cannot be created: {a_file} is not a writable directory"),
    ):
        with pytest.raises(UserError) as error:
            check_model_dir(model_dir)
        assert str(error.value) == message
    check_model_dir(str(tmp_path / "new" / "run"))  # made at the first write, not by the check
    check_model_dir(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def test_a_resume_that_would_change_the_run_is_refused_naming_what_differs(tmp_path):
    import keras

    from trainer.errors import UserError
    from trainer.files import model_dir, run_record

    def record(batch: int, units: int) -> dict:
        layers = [keras.Input((3,)), keras.layers.Dense(units, name="hidden"), keras.layers.Dense(units, name="out")]
        model = keras.Sequential(layers, name="net")  # named: Keras numbers unnamed layers process-wide
        arguments = dict(strategy="mirrored", num_replicas=2, num_workers=1, model=model, config_text="x = 1")
        return run_record.make_record(global_batch_size=batch, **arguments)

    started = record(64, 4)
    model_dir.prepare(str(tmp_path / "worker"), started, is_chief=False, start_step=0)
    model_dir.prepare(str(tmp_path), started, is_chief=True, start_step=0)
    assert not (tmp_path / "worker").exists() and run_record.read_record(str(tmp_path)) == started
    model_dir.prepare(str(tmp_path), record(32, 4), is_chief=True, start_step=0)  # the first record stays
    assert run_record.read_record(str(tmp_path)) == started

    run_record.check_resume(str(tmp_path), record(64, 4), allow_changes=False)
    with pytest.raises(UserError) as error:
        run_record.check_resume(str(tmp_path), record(32, 4), allow_changes=False)
    assert str(error.value) == (
        f"model_dir {tmp_path} was started with other settings (global_batch_size 64 -> 32); resume with the "
        "original settings, use a fresh --model_dir, or set train.allow_resume_changes = True"
    )
    changed = record(64, 5)
    found = run_record.differences(started, changed)
    assert len(found) == 4 and all(
        " [3, 4] -> [3, 5]" in f or " [4] -> [5]" in f or " [4, 4] -> [5, 5]" in f for f in found
    )
    with pytest.raises(UserError, match=r"\(variable .*; and 1 more\)"):
        run_record.check_resume(str(tmp_path), changed, allow_changes=False)
    run_record.check_resume(str(tmp_path), changed, allow_changes=True)
    run_record.check_resume(str(tmp_path / "fresh"), changed, allow_changes=False)  # nothing recorded


def test_what_a_run_refused_before_its_first_step_added_is_removed_and_what_it_rewrote_put_back(tmp_path):
    from trainer.errors import UserError
    from trainer.run.unfinished import undone_unless_a_step_finishes

    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "notes.txt").write_text("the user's\n")
    (existing / "operative_config.gin").write_text("train.total_steps = 10\n")
    before = tree_digest(str(existing))

    def refused(model_dir, *, is_chief=True, finished=False, error=None):
        error = error or UserError("bad labels")
        with pytest.raises(type(error)):
            with undone_unless_a_step_finishes(str(model_dir), is_chief=is_chief, finished=lambda: finished):
                model_dir.mkdir(exist_ok=True)
                (model_dir / "operative_config.gin").write_text("train.total_steps = 20\n")
                (model_dir / "train").mkdir()
                (model_dir / "train" / "events").write_text("written\n")
                raise error

    refused(existing)
    assert tree_digest(str(existing)) == before
    refused(tmp_path / "new")
    assert not (tmp_path / "new").exists()
    for kept, arguments in (("finished", {"finished": True}), ("other", {"error": RuntimeError("a bug")})):
        refused(tmp_path / kept, **arguments)  # a step finished, or no user mistake: nothing is undone
        assert sorted(tree_digest(str(tmp_path / kept))) == ["operative_config.gin", "train/events"]
    refused(tmp_path / "worker", is_chief=False)
    assert (tmp_path / "worker" / "train").exists()  # only the chief writes, and undoes
