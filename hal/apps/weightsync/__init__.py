"""The RL weight-sync job ``hal sync`` runs, as a library: the trainer's and the rollout's roles
(:mod:`.trainer`, :mod:`.rollout`), the typed messages between them (:mod:`.messages`), one step loop
(:mod:`.loop`) over verl's update sequence (:class:`ckpt.manager.CheckpointEngineManager`), launchers
(:mod:`.launchers`: torchrun, colocated, Ray), memory bounds (:mod:`.memory`), verification (:mod:`.verify`),
the figures of a step (:mod:`.figures`), the model presets (:mod:`.models`), LoRA adapters (:mod:`.lora`) and
the raw-broadcast reference a benchmark adds (:mod:`.raw`).

Submodules are imported on use: ``import hal.apps.weightsync`` imports neither torch nor ckpt.
"""
