"""A ParameterServerStrategy chief script: `dlrun launch --framework tf-ps train.py --hosts hosts.toml`.

dlrun runs tf.distribute.Server on every ps and worker and this script on the chief, and stops
the servers when it exits. Replace the data and model with yours.
"""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf


def main() -> None:
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    rng = np.random.default_rng(0)  # TODO: your data
    x = rng.normal(size=(2048, 16)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int64")

    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.layers.Input(shape=(16,)), tf.keras.layers.Dense(2)])
        optimizer = tf.keras.optimizers.Adam(0.01)

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        data = tf.data.Dataset.from_tensor_slices((x, y)).shard(context.num_input_pipelines, context.input_pipeline_id)
        return data.shuffle(len(x)).repeat().batch(64)

    @tf.function
    def per_worker_dataset_fn() -> tf.distribute.DistributedDataset:
        return strategy.distribute_datasets_from_function(dataset_fn)

    iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    @tf.function
    def step(it: tf.distribute.DistributedIterator) -> tf.Tensor:
        def replica(features: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(labels, model(features, training=True)))
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables,
                                          strict=True))
            return loss

        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(replica, args=next(it)), None)

    for epoch in range(3):
        results = [coordinator.schedule(step, args=(iterator,)) for _ in range(20)]
        coordinator.join()
        print(f"epoch {epoch + 1}: loss {float(results[-1].fetch()):.4f}")


if __name__ == "__main__":
    main()
