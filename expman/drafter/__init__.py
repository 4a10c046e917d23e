"""The EAGLE-3 drafter: the model and its TTT unroll, the training objective, the checkpoint formats."""
