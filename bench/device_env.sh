# Source at the start of every `device` run (carry .gl and .whl, made by ../shared/tools/device-prep.sh plus
# the pytest wheels): Vulkan loader, the wheels the device image lacks, PYTHONPATH for the repo, NVIDIA ICD.
# The daemon's tests there also need sdnotify (no wheel on PyPI: `pip wheel -w .whl sdnotify`) and
# pyproject's llguidance (>= 1.9: `pip download --abi abi3 --platform manylinux_2_31_x86_64`; older ones
# take one end token and fail the structured tests).
#   . bench/device_env.sh && python3 bench/bench_vulkan_model.py ...
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/daemon:$PWD/client:$PWD/bench:$PWD/tests
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader || true
