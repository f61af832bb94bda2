"""Train a small classifier on scikit-learn's digits with MultiWorkerMirroredStrategy.

Run it with dlrun, which gives every worker its TF_CONFIG:

    dlrun launch examples/train_digits.py                      # 2 workers on localhost
    dlrun launch examples/train_digits.py --hosts hosts.toml   # one worker per slot

The data ships inside scikit-learn (no download). Each worker reads its own shard of the
training set (tf.data auto-sharding by DATA); the global batch is the per-replica batch times
the number of workers. Every worker prints its per-epoch loss; at the end each prints the
test accuracy, and only the chief (task 0) keeps the saved model.

Keras 3 cannot ``model.fit`` under MultiWorkerMirroredStrategy (keras-team/keras#20585), so
this script opts into legacy Keras (the ``tf_keras`` package) for its own process by setting
``TF_USE_LEGACY_KERAS=1`` before TensorFlow is imported. Other jobs are not affected.

Resuming (``dlrun launch --max-restarts N``): after each epoch the chief saves the model's and
the optimizer's variables and the epoch in ``dlrun-model/``, beside the model. On a restart
(``DLRUN_RESTART_COUNT`` > 0) the chief loads them and every worker receives them through an
all-reduce (the other workers add zeros), and ``fit`` goes on from the next epoch. Keras's own
``BackupAndRestore`` is not used: every worker restores from the ``backup_dir`` it names, so it
needs one filesystem shared by all hosts, which dlrun's hosts need not have. ``--crash-after E``
makes the first attempt fail after epoch E, to try it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-per-replica", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--model-dir", default="dlrun-model")
    parser.add_argument("--checkpoint", default="dlrun-model/checkpoint-digits.npz",
                        help="the chief's, beside the saved model (relative: to its working directory)")
    parser.add_argument("--crash-after", type=int, default=0, help="the first attempt fails after this epoch")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    restart = int(os.environ.get("DLRUN_RESTART_COUNT", "0"))
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {"type": "worker", "index": 0})
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    workers = strategy.num_replicas_in_sync
    is_chief = task["type"] == "chief" or (task["type"] == "worker" and task["index"] == 0)

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")
    y = digits.target.astype("int64")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

    global_batch = args.batch_per_replica * workers
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=0, reshuffle_each_iteration=True)
        .batch(global_batch)
        .with_options(options)
    )
    print(f"worker {task['index']}: {workers} workers, global batch {global_batch}, {len(x_train)} training rows")

    with strategy.scope():
        model = tf.keras.Sequential(
            [
                tf.keras.layers.Input(shape=(64,)),
                tf.keras.layers.Dense(128, activation="relu"),
                tf.keras.layers.Dense(64, activation="relu"),
                tf.keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=tf.keras.optimizers.Adam(args.learning_rate),
            loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        model.optimizer.build(model.trainable_variables)  # its variables exist before fit: a restart fills them

    start = 0
    if restart == 0 and is_chief and os.path.exists(args.checkpoint):
        os.remove(args.checkpoint)  # an earlier job's: this job starts from scratch
    elif restart > 0:
        start = restore(strategy, model, args.checkpoint if is_chief else None)
        print(f"restart {restart}: " + (f"resuming after epoch {start}" if start else "no checkpoint, from scratch"))

    class EpochLog(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict[str, float] | None = None) -> None:
            logs = logs or {}
            print(f"epoch {epoch + 1}/{args.epochs}: loss {logs.get('loss', float('nan')):.4f} "
                  f"accuracy {logs.get('accuracy', float('nan')):.4f}")
            if is_chief:  # written aside, then renamed: a crash mid-write leaves the last one whole
                os.makedirs(os.path.dirname(args.checkpoint) or ".", exist_ok=True)
                with open(args.checkpoint + ".tmp", "wb") as out:
                    np.savez(out, np.array(epoch + 1), *[v.numpy() for v in variables(model)])
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
            if restart == 0 and epoch + 1 == args.crash_after:
                raise SystemExit(f"--crash-after {args.crash_after}: failing on purpose (worker {task['index']})")

    model.fit(train, epochs=args.epochs, initial_epoch=start, verbose=0, callbacks=[EpochLog()])

    logits = model(x_test, training=False)
    accuracy = float(np.mean(np.argmax(logits.numpy(), axis=1) == y_test))
    checksum = float(sum(np.sum(w, dtype=np.float64) for w in model.get_weights()))
    print(f"worker {task['index']} weight checksum {checksum:.6f}")
    print(f"test accuracy: {accuracy:.4f}")

    # Every worker must take part in saving; only the chief's copy is kept.
    target = args.model_dir if is_chief else tempfile.mkdtemp(prefix="dlrun-model-")
    os.makedirs(target, exist_ok=True)
    model.save(os.path.join(target, "digits.keras"))
    if is_chief:
        print(f"model saved to {os.path.join(target, 'digits.keras')}")
    else:
        shutil.rmtree(target, ignore_errors=True)


def variables(model: tf.keras.Model) -> list[tf.Variable]:
    """What a checkpoint holds besides the epoch: the model's variables, then the optimizer's."""
    return [*model.variables, *model.optimizer.variables]


def restore(strategy: tf.distribute.Strategy, model: tf.keras.Model, path: str | None) -> int:
    """The chief's checkpoint (``path`` on the chief, None elsewhere), sent to every worker by
    an all-reduce in which the others add zeros; the epoch it ends (0: there is none). Every
    worker must call it, in the same order."""
    targets = variables(model)
    saved = None
    if path is not None and os.path.exists(path):
        with np.load(path) as archive:
            saved = [archive[f"arr_{i}"] for i in range(len(archive.files))]
    header = [np.array(float(saved[0]) if saved else 0.0)]
    values = saved[1:] if saved else [np.zeros(v.shape, v.dtype.as_numpy_dtype) for v in targets]
    epoch = int(from_chief(strategy, header)[0])
    if epoch:
        for variable, value in zip(targets, from_chief(strategy, values), strict=True):
            variable.assign(value)
    return epoch


def from_chief(strategy: tf.distribute.Strategy, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """The sum over workers of each array: the chief's values where the others give zeros."""
    per_replica = strategy.run(lambda: [tf.constant(a) for a in arrays])
    return [strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None).numpy() for v in per_replica]


if __name__ == "__main__":
    main()
