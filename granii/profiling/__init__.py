"""Profiling harness: graph generators, the training corpus and the per-machine cost-model training
(``granii-init``: ``init_machine``). It imports the library's cost-model code; nothing else in
``granii`` imports it."""
