"""Several processes: what torchloom adds to Accelerate and torch.distributed for sharded runs (FSDP2's DTensor
parameters), and nothing that Accelerate or torch already does."""
