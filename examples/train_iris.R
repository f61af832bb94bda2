# Train a small classifier on R's iris data with TensorFlow's MultiWorkerMirroredStrategy,
# from R through reticulate.
#
#   dlrun launch examples/train_iris.R                        # 2 workers on localhost
#   dlrun launch examples/train_iris.R --hosts hosts.toml     # one worker per slot
#
# dlrun runs a .R script with Rscript and gives every worker its TF_CONFIG, which TensorFlow
# reads when the strategy is made. reticulate runs the Python of RETICULATE_PYTHON: dlrun sets
# it to the host's python from the inventory (the one running dlrun, on this machine), so
# TensorFlow and tf_keras must be installed there; R needs only reticulate
# (Debian: apt install r-base-core r-cran-reticulate).
#
# The data is R's own iris (the datasets package: no download). Each worker reads its shard
# of every global batch (tf.data auto-sharding by DATA). Every worker prints its per-epoch
# loss, which MultiWorkerMirroredStrategy averages over the workers, so all print the same.
# Keras 3 cannot model.fit under MultiWorkerMirroredStrategy (keras-team/keras#20585): the
# script uses legacy Keras (tf_keras) by setting TF_USE_LEGACY_KERAS before TensorFlow loads.

Sys.setenv(TF_USE_LEGACY_KERAS = "1")
if (Sys.getenv("TF_CPP_MIN_LOG_LEVEL") == "") Sys.setenv(TF_CPP_MIN_LOG_LEVEL = "2")
library(reticulate)

args <- commandArgs(trailingOnly = TRUE)
epochs <- if (length(args) >= 1) as.integer(args[[1]]) else 5L

tf <- import("tensorflow")
strategy <- tf$distribute$MultiWorkerMirroredStrategy()
workers <- strategy$num_replicas_in_sync
rank <- Sys.getenv("DLRUN_RANK", "0")

# reticulate hands R vectors to Python as lists (no NumPy: Debian's reticulate 1.28 cannot
# convert to or from NumPy 2); TensorFlow makes the tensors
x <- scale(as.matrix(iris[, 1:4]))
features <- tf$constant(as.numeric(t(x)), shape = list(nrow(x), 4L), dtype = tf$float32)
labels <- tf$constant(as.integer(iris$Species) - 1L, dtype = tf$int64)
global_batch <- as.integer(16L * workers)
options <- tf$data$Options()
options$experimental_distribute$auto_shard_policy <- tf$data$experimental$AutoShardPolicy$DATA
train <- tf$data$Dataset$from_tensor_slices(tuple(features, labels))
train <- train$shuffle(nrow(x), seed = 0L)$`repeat`()$batch(global_batch)$with_options(options)
cat(sprintf("worker %s: %d workers, global batch %d, %d rows\n", rank, workers, global_batch, nrow(x)))

tf$random$set_seed(0L)
with(strategy$scope(), {
  model <- tf$keras$Sequential(list(
    tf$keras$layers$Input(shape = list(4L)),
    tf$keras$layers$Dense(16L, activation = "relu"),
    tf$keras$layers$Dense(3L)
  ))
  model$compile(
    optimizer = tf$keras$optimizers$Adam(0.05),
    loss = tf$keras$losses$SparseCategoricalCrossentropy(from_logits = TRUE),
    metrics = list("accuracy")
  )
})

history <- model$fit(train, epochs = epochs, steps_per_epoch = 10L, verbose = 0L)
losses <- unlist(history$history$loss)
for (epoch in seq_along(losses)) {
  cat(sprintf("epoch %d/%d: loss %.4f\n", epoch, epochs, losses[[epoch]]))
}
builtins <- import_builtins()
checksum <- sum(vapply(model$trainable_variables, function(v) builtins$float(tf$reduce_sum(v)), numeric(1)))
cat(sprintf("worker %s final loss %.6f weight checksum %.6f\n", rank, losses[[length(losses)]], checksum))
