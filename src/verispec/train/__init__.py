"""Self-distillation training of early-exit heads (`verispec train-exit`).

- `corpus`: the training text: prompts written for this project, continued by the target itself.
- `exit_head`: labelling the corpus with the target, training the head, checkpoints, evaluation.
"""
