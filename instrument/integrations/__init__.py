"""Framework integrations: probewire attached by a framework's own callback mechanism.

``hf.ProbewireCallback`` (and ``hf.watch``) for the transformers ``Trainer``;
``lightning.ProbewireCallback`` for PyTorch Lightning. Each opens the monitor's step
context around one optimizer step, records the loss of every micro-batch as per-token
values with their valid mask, measures the gradients before clipping and closes the
monitor (the run finished) at the end of training. Import the module you need: each
imports its framework.
"""
