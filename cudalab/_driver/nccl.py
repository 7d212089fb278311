"""The real NCCL backend over nccl4py (being written: issue 19)."""
