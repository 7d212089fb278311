"""The kernel facility (:mod:`cudalab._kernels.kernel`) and the runtime's own CUDA kernels.

Each kernel module defines its kernels with a numpy implementation for the simulator:
``fill`` (the typed fills behind ``DeviceArray.fill_``), ``spin`` (busy-wait kernels for
timing tests) and ``philox`` (the RNG's, loaded when :mod:`cudalab.random` first needs them).
Nothing is imported here, so importing the facility does not define any kernel;
``cudalab.kernels.all_kernels()`` imports every kernel module.
"""
