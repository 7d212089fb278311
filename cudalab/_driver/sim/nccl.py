"""The simulator's NCCL (being written: issue 19)."""
