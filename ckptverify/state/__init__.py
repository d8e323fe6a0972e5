"""Training state beyond model and optimizer: random streams (:mod:`~ckptverify.state.rng`, keyed by rank), a
resumable sharding sampler (:mod:`~ckptverify.state.sampler`) and data loader positions
(:mod:`~ckptverify.state.dataloader`)."""
