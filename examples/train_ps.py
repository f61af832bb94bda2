"""Train on scikit-learn's digits with ParameterServerStrategy (chief + workers + ps).

    dlrun launch --framework tf-ps --hosts hosts.toml examples/train_ps.py

The inventory gives hosts roles (one ``chief``, ``worker``s, ``ps``, at most one ``evaluator``). dlrun runs a
``tf.distribute.Server`` on every ps and worker and this script on the chief, which drives
them with a ``ClusterCoordinator``: variables live on the ps tasks, steps run on the workers.
When this script exits, dlrun stops the servers and exits with this script's code.

Resuming (``dlrun launch --max-restarts N``): the chief alone runs the training loop, so after
each epoch it reads the model's and the optimizer's variables from the ps tasks and saves them
with the epoch in its own working directory; on ``DLRUN_RESTART_COUNT`` > 0 it assigns them
back and goes on from the next epoch. (``tf.train.Checkpoint`` would make every ps write its
own shard to that path, which needs a filesystem the hosts share.) ``--crash-after E`` makes
the first attempt fail after epoch E, to try it.
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
    parser.add_argument("--checkpoint", default="checkpoint-ps.npz", help="the chief's, in its working directory")
    parser.add_argument("--crash-after", type=int, default=0, help="the first attempt fails after this epoch")
    args = parser.parse_args()
    restart = int(os.environ.get("DLRUN_RESTART_COUNT", "0"))

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
        optimizer.build(model.trainable_variables)  # its variables exist before the first step: a restart fills them
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

    saved = [*model.variables, *optimizer.variables]  # held by the ps tasks; read and written from here
    start = 0
    if restart == 0 and os.path.exists(args.checkpoint):
        os.remove(args.checkpoint)  # an earlier job's: this job starts from scratch
    elif restart > 0:
        if os.path.exists(args.checkpoint):
            with np.load(args.checkpoint) as archive:
                start = int(archive["arr_0"])
                for i, variable in enumerate(saved):
                    variable.assign(archive[f"arr_{i + 1}"])
        print(f"restart {restart}: " + (f"resuming after epoch {start}" if start else "no checkpoint, from scratch"))

    for epoch in range(start, args.epochs):
        train_loss.reset_states()
        for _ in range(args.steps_per_epoch):
            coordinator.schedule(step_fn, args=(iterator,))
        coordinator.join()
        print(f"epoch {epoch + 1}/{args.epochs}: loss {float(train_loss.result()):.4f}")
        with open(args.checkpoint + ".tmp", "wb") as out:  # then renamed: a crash mid-write keeps the last one
            np.savez(out, np.array(epoch + 1), *[v.numpy() for v in saved])
        os.replace(args.checkpoint + ".tmp", args.checkpoint)
        if restart == 0 and epoch + 1 == args.crash_after:
            raise SystemExit(f"--crash-after {args.crash_after}: failing on purpose (chief)")

    logits = model(x_test, training=False)
    print(f"test accuracy: {float(np.mean(np.argmax(logits.numpy(), axis=1) == y_test)):.4f}")


if __name__ == "__main__":
    main()
