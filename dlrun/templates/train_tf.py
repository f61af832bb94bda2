"""A MultiWorkerMirroredStrategy training script: `dlrun launch train.py --hosts hosts.toml`.

dlrun gives every worker its TF_CONFIG. Replace make_data() and make_model() with yours.
Keras 3 cannot model.fit under MultiWorkerMirroredStrategy (keras-team/keras#20585), so this
script uses legacy Keras (pip install tf_keras) for its own process.
"""

import json
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

BATCH_PER_REPLICA = 32


def make_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)  # TODO: load your data (each worker reads its shard below)
    x = rng.normal(size=(2048, 16)).astype("float32")
    return x, (x.sum(axis=1) > 0).astype("int64")


def make_model() -> tf.keras.Model:
    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(16,)), tf.keras.layers.Dense(32, activation="relu"),
                                 tf.keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def main() -> None:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {"index": 0})
    x, y = make_data()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0)
    data = data.batch(BATCH_PER_REPLICA * strategy.num_replicas_in_sync).with_options(options)
    with strategy.scope():
        model = make_model()
    model.fit(data, epochs=3, verbose=2 if task["index"] == 0 else 0)
    print("done:", model.evaluate(x, y, verbose=0))


if __name__ == "__main__":
    main()
