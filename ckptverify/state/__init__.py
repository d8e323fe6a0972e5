"""Full training state beyond the model and optimizer: random number generators and data position.

* :mod:`ckptverify.state.rng` captures and restores every random stream a training step draws from
  (python ``random``, numpy's global generator, torch CPU and CUDA generators, named user generators),
  keyed by rank so DCP keeps each rank's copy.
* :mod:`ckptverify.state.sampler` is a map-style sampler that shards like ``DistributedSampler`` and
  resumes mid-epoch at the exact next index.
* :mod:`ckptverify.state.dataloader` saves and restores the data position of a loader, dispatching on the
  loader type (torchdata's ``StatefulDataLoader``, or a ``DataLoader`` driven by a resumable sampler).
"""
