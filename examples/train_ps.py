"""Train on scikit-learn's digits with ParameterServerStrategy (chief + workers + ps).

    dlrun launch --framework tf-ps --hosts hosts.toml examples/train_ps.py

The inventory gives hosts roles (one ``chief``, ``worker``s, ``ps``, at most one ``evaluator``). dlrun runs a
``tf.distribute.Server`` on every ps and worker and this script on the chief, which drives
them with a ``ClusterCoordinator``: variables live on the ps tasks, steps run on the workers.
When this script exits, dlrun stops the servers and exits with this script's code.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type == "evaluator":  # a side-car evaluator (role = "evaluator") would read checkpoints
        print(f"evaluator: beside {resolver.cluster_spec().num_tasks('worker')} workers; this example has no "
              "checkpoints to evaluate")
        return
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    workers = resolver.cluster_spec().num_tasks("worker")
    print(f"chief: {workers} workers, {resolver.cluster_spec().num_tasks('ps')} ps")

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.layers.Input(shape=(64,)), tf.keras.layers.Dense(128, activation="relu"),
             tf.keras.layers.Dense(10)]
        )
        optimizer = tf.keras.optimizers.Adam(0.01)
        train_loss = tf.keras.metrics.Mean()

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        data = tf.data.Dataset.from_tensor_slices((x_train, y_train))
        data = data.shard(context.num_input_pipelines, context.input_pipeline_id)
        return data.shuffle(len(x_train), seed=0).repeat().batch(args.batch)

    @tf.function
    def per_worker_dataset_fn() -> tf.distribute.DistributedDataset:
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step_fn(it: tf.distribute.DistributedIterator) -> tf.Tensor:
        def replica_fn(features: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            train_loss.update_state(loss)
            return loss

        features, labels = next(it)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica_fn, args=(features, labels)), None)

    for epoch in range(args.epochs):
        train_loss.reset_states()
        for _ in range(args.steps_per_epoch):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        print(f"epoch {epoch + 1}/{args.epochs}: loss {float(train_loss.result()):.4f}")

    logits = model(x_test, training=False)
    print(f"test accuracy: {float(np.mean(np.argmax(logits.numpy(), axis=1) == y_test)):.4f}")


if __name__ == "__main__":
    main()
