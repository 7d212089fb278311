"""IPython magics (``%load_ext cudalab``, ``%%cuda_timed``, ``%cuda_memory``): issue 6, not yet built."""
