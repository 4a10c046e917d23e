"""The train and baseline stages: the training loop, its batch feed, data parallelism."""
