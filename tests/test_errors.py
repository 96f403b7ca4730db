"""`error_line`: a TensorFlow error (or any exception) as the one line its message means, and
`peer_failure`, the one line of training stopped by a task of the cluster that is gone."""

from __future__ import annotations

import pytest
import tensorflow as tf

from trainer.errors import MAX_LINE, RunFailure, error_line, peer_failure


def test_a_long_tensorflow_message_ends_on_a_whole_sentence():
    sentence = "The first sentence says what happened. "
    line = error_line(RuntimeError(sentence * 20))
    assert len(line) <= MAX_LINE and line.endswith("what happened") and not line.endswith(".")
    words = error_line(RuntimeError("word " * 100))
    assert len(words) <= MAX_LINE + 3 and words.endswith("word...")


def test_an_error_in_a_keras_layers_call_is_its_cause_and_the_call():
    import keras

    class Picky(keras.layers.Layer):
        def call(self, x):
            raise ValueError("Picky takes no zeros")

    with pytest.raises(ValueError) as raised:  # Keras' first line: "Exception encountered when calling ..."
        Picky()(tf.zeros([2, 3]))
    assert error_line(raised.value) == "ValueError in Picky.call(): Picky takes no zeros"


def test_a_graph_error_is_what_happened_not_where():
    labels = tf.constant([10, 1])

    @tf.function
    def loss():
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.zeros([2, 10]))

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        loss()
    assert str(raised.value).startswith("Graph execution error")  # then the node, its stack, the message
    assert error_line(raised.value) == (
        "Received a label value of 10 which is outside the valid range of [0, 10).  Label values: 10 1"
    )
    with pytest.raises(tf.errors.UnimplementedError) as raised:
        tf.function(lambda x: tf.cast(x, tf.int32))(tf.constant(["a"]))
    assert error_line(raised.value) == "Cast string to int32 is not supported"  # no {{function_node ...}}


def test_a_lost_peer_is_one_line_with_where_a_rerun_continues():
    error = tf.errors.UnavailableError(
        None,
        None,
        "Graph execution error:\n\nDetected at node x defined at (most recent call last):\n"
        "<stack traces unavailable>\nSocket closed.\nAdditional GRPC error information from remote target",
    )
    failure = peer_failure(error, "in steps 101-150", "a peer task may have died or timed out", "/d/ckpt-100")
    assert isinstance(failure, RunFailure) and str(failure) == (
        "training failed in steps 101-150 (UnavailableError: Socket closed); a peer task may have died or "
        "timed out; a rerun continues from /d/ckpt-100"
    )
    assert str(peer_failure(error, "during evaluation", "lost a parameter server")).endswith(
        "lost a parameter server; rerun the same command to continue from the newest checkpoint (if there is one)"
    )
