"""MLflow and the model registry: stage runs, registry reads, the register stage, compare, promote, runs."""
