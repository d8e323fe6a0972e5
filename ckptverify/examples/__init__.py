"""Built-in example workloads: a synthetic token corpus and a tiny GPT trained on it."""

from ckptverify.examples.corpus import TokenDataset
from ckptverify.examples.tinygpt import (
    TinyGPT,
    TinyGPTConfig,
    Training,
    WarmupCosine,
    build_training,
    make_loader,
    train_step,
    wrap_fsdp2,
)

__all__ = ["TinyGPT", "TinyGPTConfig", "TokenDataset", "Training", "WarmupCosine", "build_training", "make_loader",
           "train_step", "wrap_fsdp2"]
