"""NPU offload through XRT (pyxrt) to the Ryzen AI NPU: npu1 (Phoenix / Hawk Point), npu2 (Strix and later).

xrt.py (finding and opening the device, once per process), kernels.py (the kernel catalogue and the installed
build), context.py (one hardware context, kernel and set of buffer objects per kernel, for the daemon's
life), host.py (bf16 / int8 numerics, padding), ops.py (tiled GEMMs and prefill attention over the kernels),
routing.py (first-use checks and fallback to the CPU), backend.py (``backend: npu``), status.py (what
``hmactl status`` says, also for the other backends).

No code here has run on NPU hardware; the tests run it against tests/fake_pyxrt.py, an XRT stand-in.
"""
